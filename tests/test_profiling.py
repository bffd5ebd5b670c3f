"""trlx_scale.profiling: exclusive phase timers, FLOPs counted by hand, and the metrics every trainer logs."""

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from trlx_scale.profiling.device_peak import device_peak_tflops, gpu_peak_tflops, measured_cpu_peak_tflops
from trlx_scale.profiling.flops import ModelFlops, generation_flops
from trlx_scale.profiling.phase_timer import PHASES, PhaseTimer

from .helpers.models import tiny_llama_config
from .helpers.trainers import logged, small_dpo_config


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_nested_phases_are_exclusive_and_sum_to_the_wall_time():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    with timer.phase("rollout"):
        clock.now += 1.0
        with timer.phase("generation"):
            clock.now += 2.0
            with timer.phase("weight_sync"):
                clock.now += 0.5
            clock.now += 3.0
        clock.now += 0.25
    timer.count("generated_tokens", 10)
    timer.count("generated_tokens", 5)
    seconds, counters = timer.take()
    assert seconds == {"rollout": 1.25, "generation": 5.0, "weight_sync": 0.5}
    assert sum(seconds.values()) == clock.now  # phases never overlap
    assert counters == {"generated_tokens": 15.0}
    assert timer.take() == ({}, {})  # take() resets


def test_absorbing_and_reentrant_phases_and_take_splits_an_open_phase():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    with timer.phase("ref_scoring", absorb=True):
        with timer.phase("ref_logprobs"):  # absorbed: counts as ref_scoring
            clock.now += 2.0
    with timer.phase("generation"), timer.phase("generation"):  # re-entering an open phase is a no-op
        clock.now += 1.0
    assert timer.take()[0] == {"ref_scoring": 2.0, "generation": 1.0}
    timer.begin("optimizer")
    clock.now += 1.0
    assert timer.take()[0] == {"optimizer": 1.0}  # split at take(), still running
    clock.now += 0.5
    timer.end("optimizer")
    timer.end("optimizer")  # closing twice is harmless (a callback after an exception)
    assert timer.take()[0] == {"optimizer": 0.5}


def test_unknown_phase_is_refused_and_a_disabled_timer_records_nothing():
    with pytest.raises(ValueError, match="unknown phase 'decode'"):
        PhaseTimer().begin("decode")
    timer = PhaseTimer(enabled=False)
    with timer.phase("generation"):
        timer.count("flops", 1)
    assert timer.take() == ({}, {})
    assert PHASES[-1] == "other"


def test_an_exception_unwinds_inner_phases():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    with pytest.raises(RuntimeError), timer.phase("loss_forward_backward"):
        timer.begin("rollout")  # never closed by its owner
        clock.now += 1.0
        raise RuntimeError
    assert timer.current is None
    assert timer.take()[0] == {"rollout": 1.0, "loss_forward_backward": 0.0}


def test_flops_of_a_tiny_llama_match_a_hand_count():
    """TINY_LLAMA: 2 layers, hidden 64, 4 heads x 16, 2 KV heads, MLP 128, vocabulary 100, untied head.

    Matmul parameters per layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate/up/down 3x64x128 = 36,864; two layers
    73,728, plus the LM head 100x64 = 6,400: N = 80,128 (the input embedding and the norms are no matmuls).
    Forward over rows of 3 and 5 tokens: 2 N x 8 = 1,282,048, attention 4 x d_attn 64 x 2 layers x (1+2+3 + 1+..+5
    = 21) = 10,752: 1,292,800.
    LoRA r=4 on q_proj and v_proj: q 4x64 + 64x4 = 512, v 4x64 + 32x4 = 384, per layer 896, N_lora = 1,792.
    Training (base frozen): (4 N + 6 N_lora) x 8 + 3 x 10,752 = 2,650,112 + 32,256 = 2,682,368.
    Generation, one prompt of 3 prefilled once, two completions of 2: prefill 2 N x 3 + 4 x 64 x 2 x 6 = 483,840;
    each completion 2 N x 2 + 512 x (4 + 5) = 325,120; total 1,134,080.
    """
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    shape = ModelFlops.of(model)
    assert (shape.base_matmul_params, shape.lora_matmul_params) == (80_128, 0)
    assert (shape.num_layers, shape.attention_width, shape.base_trainable) == (2, 64, True)
    assert shape.forward_flops([3, 5]) == 1_292_800
    assert shape.training_flops([3, 5]) == 6 * 80_128 * 8 + 3 * 10_752  # full fine-tuning: 6N + 3 x attention
    assert generation_flops(shape, [3], [(3, 2), (3, 2)]) == 1_134_080

    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    shape = ModelFlops.of(lora)
    assert (shape.base_matmul_params, shape.lora_matmul_params, shape.base_trainable) == (80_128, 1_792, False)
    assert shape.training_flops([3, 5]) == 2_682_368


def test_device_peaks():
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_peak_tflops("NVIDIA H200") == 989.0
    assert gpu_peak_tflops("Tesla T4") is None
    assert device_peak_tflops(torch.device("cpu"), torch.float32, override=1.5) == 1.5
    measured = measured_cpu_peak_tflops(torch.float32, size=256, repeats=2)
    assert 1e-4 < measured < 100  # a real measurement: positive and below any CPU's reach


def _check_step_metrics(trainer, phases: set[str]):
    """The metrics every trainer logs: phases that cover the step, throughput, MFU, a cheap profiler."""
    entries = [e for e in trainer.state.log_history if "time/step" in e]
    assert len(entries) == trainer.state.global_step
    timed = entries[1:]  # the first step carries the engine's warm-up
    for entry in timed:
        step = entry["time/step"]
        named = sum(entry.get(f"time/{p}", 0.0) for p in PHASES if p not in ("other", "ref_scoring"))
        # The named phases and "other" (logging, the data loader, the scheduler) add up to the step.
        assert named == pytest.approx(step - entry["time/other"], rel=1e-6)
        assert 0 < entry["perf/mfu"] < 1
    # The named phases cover the step, and the profiler costs next to nothing. A phase left untimed, or a costly
    # profiler, weighs on every step; a garbage collection or a descheduled process on a loaded machine weighs on one
    # (a full run once saw one such step). So the least disturbed step is the one held to the bound. These steps last
    # 0.05-0.3 s, where the ~5 ms of logging and collation per step weigh more than on real steps (docs/benchmarks.md:
    # "other" on the GRPO step benchmark).
    calmest = min(timed, key=lambda entry: entry["time/other"] / entry["time/step"])
    assert calmest["time/other"] < max(0.1 * calmest["time/step"], 0.05), timed
    assert min(entry["time/profiler_fraction"] for entry in timed) < 0.01, timed
    seen = {key.removeprefix("time/") for e in entries for key in e if key.startswith("time/")}
    assert phases <= seen, seen
    assert all(e["throughput/trained_tokens_per_s"] > 0 for e in entries)
    return entries


def test_grpo_logs_every_phase_throughput_and_mfu(default_model_dir, tmp_path):
    from trlx_scale import GRPOTrainer
    from trlx_scale.tasks import addition_dataset, exact_match_reward

    from .helpers.trainers import small_grpo_config

    args = small_grpo_config(
        tmp_path, use_vllm=True, vllm_dtype="trainer", max_steps=3, shared_prefix="auto", beta=0.1
    )
    trainer = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=addition_dataset("train", size=64),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    trainer.train()
    phases = {"generation", "weight_sync", "reward", "ref_logprobs", "rollout", "loss_forward_backward", "optimizer"}
    entries = _check_step_metrics(trainer, phases)
    # Generated tokens per step = TRL's completion-length mean x rows (8): the rate times the step time says so.
    for entry in entries:
        generated = entry["throughput/generated_tokens_per_s"] * entry["time/step"]
        assert generated == pytest.approx(entry["completions/mean_length"] * 8, rel=1e-6)


def test_ppo_times_the_critic_and_the_reference(default_model_dir, tmp_path):
    from trlx_scale import PPOConfig, PPOTrainer
    from trlx_scale.tasks import addition_dataset, exact_match_reward

    from .helpers.trainers import small_grpo_config

    args = small_grpo_config(tmp_path, PPOConfig, max_steps=3, critic_learning_rate=1e-3)
    trainer = PPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=addition_dataset("train", size=32),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    trainer.train()
    _check_step_metrics(trainer, {"generation", "reward", "ref_logprobs", "critic", "loss_forward_backward"})


def test_dpo_logs_reference_scoring_once_and_step_phases(default_model_dir, tmp_path):
    from trlx_scale import DPOTrainer
    from trlx_scale.tasks import addition_preference_dataset

    args = small_dpo_config(tmp_path, max_steps=3, precompute_ref_log_probs=True)
    trainer = DPOTrainer(
        model=default_model_dir,
        args=args,
        train_dataset=addition_preference_dataset("train", size=64),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    trainer.train()
    _check_step_metrics(trainer, {"loss_forward_backward", "optimizer"})
    scoring = logged(trainer, "time/ref_scoring")
    assert len(scoring) == 1 and scoring[0] > 0  # once, with the first step's metrics
    assert not any(math.isnan(v) for v in logged(trainer, "perf/mfu"))


def test_profiling_off_logs_no_timing(default_model_dir, tmp_path):
    from trlx_scale import GRPOTrainer
    from trlx_scale.tasks import addition_dataset, exact_match_reward

    from .helpers.trainers import small_grpo_config

    trainer = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=small_grpo_config(tmp_path, profile_phases=False),
        train_dataset=addition_dataset("train", size=64),
    )
    trainer.train()
    assert not any(key.startswith(("time/", "perf/")) for e in trainer.state.log_history for key in e)


def test_two_ranks_reduce_times_by_max_and_work_by_sum(tmp_path):
    """Rank r: step 1 lasts 2+r s (generation 1+2r, loss 0.8-0.5r), step 2 1 s (generation 0.5). Means over the 2 steps
    of the per-step max: step (3+1)/2 = 2, generation (3+0.5)/2 = 1.75, loss 0.8/2 = 0.4. Tokens summed over ranks:
    generated (100+200) + (50+50) = 400 over 4 s of steps = 100/s; FLOPs (4+4+2+2)e12 / 4 s / 2 devices = 1.5 TFLOP/s,
    MFU 0.15 at a 10 TFLOP/s peak."""
    from .helpers.launch import run_torchrun_report

    metrics = run_torchrun_report("profile_reduction.py", tmp_path / "report.json", port=29541)
    assert metrics["time/step"] == pytest.approx(2.0)
    assert metrics["time/generation"] == pytest.approx(1.75)
    assert metrics["time/loss_forward_backward"] == pytest.approx(0.4)
    assert metrics["throughput/generated_tokens_per_s"] == pytest.approx(100.0)
    assert metrics["throughput/trained_tokens_per_s"] == pytest.approx(20 / 4)
    assert metrics["perf/tflops_per_device"] == pytest.approx(1.5)
    assert metrics["perf/mfu"] == pytest.approx(0.15)
    assert metrics["time/profiler_fraction"] >= 0.002 / 4  # the slower rank's bookkeeping
