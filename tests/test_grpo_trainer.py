"""trlx_scale.GRPOTrainer: drop-in for trl.GRPOTrainer, and the colocated vLLM engine it builds."""

import asyncio
import gc
import threading

import pytest
import torch
import trl
from trl.generation.vllm_generation import VLLMGeneration

from trlx_scale import GRPOConfig, GRPOTrainer
from trlx_scale.generation.colocated_generation import ColocatedVLLMGeneration
from trlx_scale.tasks import addition_dataset, exact_match_reward

from .helpers.trainers import logged, small_grpo_config


def _small_args(config_cls, tmp_path, **overrides):
    return small_grpo_config(tmp_path / "out", config_cls=config_cls, **overrides)


def _engine_ids() -> set[int]:
    """Ids of live TRL generation engines (ours subclass TRL's, so both kinds are counted)."""
    gc.unfreeze()  # vLLM gc.freeze()s after start-up, which hides older objects from gc.get_objects()
    gc.collect()
    return {id(o) for o in gc.get_objects() if isinstance(o, VLLMGeneration)}


_logged = logged


def _short_answer_reward(completions, **kwargs):
    return [1.0 / (1 + len(completion)) for completion in completions]


async def _awaited_exact_match(completions, answer, **kwargs):
    await asyncio.sleep(0.01)
    return exact_match_reward(completions=completions, answer=answer)


def test_identical_to_trl_when_no_option_is_on(default_model_dir, tmp_path):
    """Same seed, same data, HF generation: both trainers end with bit-identical weights and the same losses, the
    rewards scored by trlx_scale's scorer (the functions concurrently, the async one awaited) as TRL's loop scores
    them. Padded rows, as TRL's: packed rows (padding_free, on by default) give the padded loss up to float rounding,
    not bit for bit (tests/test_packing.py)."""
    results = []
    for trainer_cls, config_cls in ((trl.GRPOTrainer, trl.GRPOConfig), (GRPOTrainer, GRPOConfig)):
        padding = {"padding_free": False, "shared_prefix": "false"} if config_cls is GRPOConfig else {}
        trainer = trainer_cls(
            model=default_model_dir,
            reward_funcs=[exact_match_reward, _short_answer_reward, _awaited_exact_match],
            args=_small_args(config_cls, tmp_path / trainer_cls.__module__, **padding),
            train_dataset=addition_dataset("train", size=64),
        )
        trainer.train()
        results.append((_logged(trainer, "loss"), {k: v.clone() for k, v in trainer.model.state_dict().items()}))
        rewards = _logged(trainer, "reward")
        results[-1] += (rewards,)
    (trl_losses, trl_weights, trl_rewards), (our_losses, our_weights, our_rewards) = results
    assert trl_losses == our_losses and len(our_losses) == 2
    assert trl_rewards == our_rewards
    assert trl_weights.keys() == our_weights.keys()
    assert all(torch.equal(trl_weights[k], our_weights[k]) for k in trl_weights)
    # And training did change the weights, so the equality above is not trivially true.
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(default_model_dir).state_dict()
    assert any(not torch.equal(initial[k], our_weights[k]) for k in initial)


def test_reward_functions_run_concurrently_with_trls_arguments(default_model_dir, tmp_path):
    """The synchronous trainer scores with the asynchronous producer's scorer: two synchronous reward functions meet
    at a barrier (run one after the other, as TRL's loop runs them, they could not: the first would wait alone and
    fail), each gets TRL's arguments (the dataset's columns, a TrainerState snapshot, log_metric, log_extra), and
    what log_metric is given is logged."""
    from transformers import TrainerState

    meeting = threading.Barrier(2, timeout=30)
    seen = []
    before = set(threading.enumerate())

    def meets(name):
        def reward(prompts, completions, completion_ids, answer, trainer_state, log_metric, log_extra, **kwargs):
            meeting.wait()
            seen.append((name, isinstance(trainer_state, TrainerState), len(answer) == len(completions)))
            log_metric(f"{name}/calls", 1.0)
            log_extra(f"{name}_note", ["ok"] * len(completions))
            return exact_match_reward(completions=completions, answer=answer)

        reward.__name__ = name
        return reward

    trainer = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=[meets("first"), meets("second")],
        args=_small_args(GRPOConfig, tmp_path, max_steps=1),
        train_dataset=addition_dataset("train", size=64),
    )
    trainer.train()
    assert sorted(seen) == [("first", True, True), ("second", True, True)]
    assert _logged(trainer, "first/calls") == [1.0] and _logged(trainer, "second/calls") == [1.0]
    assert len(_logged(trainer, "rewards/first/mean")) == 1
    # The scorer's threads end with the run, and a later run starts them again. (Only this trainer's threads count:
    # a scorer another test left open is not this test's business.)
    started = [t for t in threading.enumerate() if t.name.startswith("trlx-scale-reward") and t not in before]
    for thread in started:
        thread.join(timeout=10)
    assert not [thread.name for thread in started if thread.is_alive()]
    trainer.train()
    assert len(seen) == 4
    in_turn = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=[meets("first"), meets("second")],
        args=_small_args(GRPOConfig, tmp_path / "sequential", reward_scoring="sequential"),
        train_dataset=addition_dataset("train", size=64),
    )
    assert in_turn._rollout_scorer is None  # TRL's own loop, one function after the other on the trainer's thread


def test_script_written_for_trl_runs_with_trlx_scale_import(default_model_dir, tmp_path):
    """A TRL config object (no trlx_scale fields) with vLLM colocate: one engine, TRL's defaults, it trains."""
    before = _engine_ids()
    args = _small_args(trl.GRPOConfig, tmp_path, use_vllm=True, vllm_mode="colocate")
    given = {name: getattr(args, name) for name in args.__dataclass_fields__}
    trainer = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=addition_dataset("train", size=64),
    )
    # TRL was handed a copy saying use_vllm=False (so it starts no engine); the caller's object never changed.
    assert {name: getattr(args, name) for name in args.__dataclass_fields__} == given
    assert _engine_ids() - before == {id(trainer.vllm_generation)}, "exactly one engine per process"
    assert isinstance(trainer.vllm_generation, ColocatedVLLMGeneration) and trainer.use_vllm
    assert trainer.args.use_vllm, "the user's config object is left as it was given"
    assert trainer.vllm_generation.dtype == "auto"  # TRL's choice when no trlx_scale option is set
    trainer.train()
    assert trainer.state.global_step == 2
    assert len(_logged(trainer, "reward")) == 2


@pytest.mark.parametrize("use_peft", [False, True], ids=["full", "lora"])
def test_colocated_engine_stays_in_sync_with_the_policy(default_model_dir, tmp_path, use_peft):
    """After every optimizer step the engine serves the updated weights: TRL logs the gap between vLLM's and the
    trainer's log-probs of the sampled tokens; with both in fp32 it must stay at rounding noise."""
    from peft import LoraConfig

    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear") if use_peft else None
    trainer = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=_small_args(GRPOConfig, tmp_path, use_vllm=True, vllm_dtype="trainer", max_steps=4, learning_rate=5e-3),
        train_dataset=addition_dataset("train", size=64),
        peft_config=peft_config,
    )
    assert trainer.vllm_generation.dtype == "float32"
    trainer.train()
    gaps = _logged(trainer, "sampling/sampling_logp_difference/mean")
    assert len(gaps) == 4
    assert max(gaps) < 1e-3, gaps
    # The weights moved a lot at this learning rate, so a stale engine would show a large gap.
    assert max(_logged(trainer, "grad_norm")) > 0
