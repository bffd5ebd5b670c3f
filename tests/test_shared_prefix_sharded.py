"""The shared-prefix pass under DeepSpeed ZeRO-3 (2 CPU processes through `accelerate launch`): the ranks agree per
chunk (one all-reduce), so shared_prefix='true' runs under sharding, and a run with it logs the same losses and
gradient norms as the duplicated pass up to float rounding: LoRA, and full fine-tuning with (non-reentrant) gradient
checkpointing. LoRA with gradient checkpointing is refused with the reason: TRL forces reentrant checkpointing for
PEFT under ZeRO-3, which cuts the gradient of the shared states. Under FSDP2 (raw fully_shard under torchrun), the
pass gives the duplicated pass's log-probs and gradients."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from .helpers.launch import ACCELERATE_LAUNCH, LAUNCH_VARIABLES, REPO_ROOT, run_torchrun_report

EXAMPLE = os.path.join(REPO_ROOT, "examples", "grpo.py")


def _zero3_run(
    tmp_path, shared_prefix: str, port: int, checkpointing: str = "false", expect_ok: bool = True, extra=()
):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    for name in LAUNCH_VARIABLES:
        env.pop(name, None)
    out = tmp_path / shared_prefix
    config = os.path.join(REPO_ROOT, "configs", "accelerate", "cpu_zero3.yaml")
    command = [*ACCELERATE_LAUNCH, "--config_file", config, "--main_process_port", str(port), EXAMPLE]
    # 8 held-out prompts: the accuracy is not what is compared (0 would score the embedded task's whole split).
    command += ["--max_steps", "2", "--eval_size", "8", "--logging_steps", "1", "--output_dir", str(out)]
    command += ["--per_device_train_batch_size", "32", "--shared_prefix", shared_prefix]
    command += ["--gradient_checkpointing", checkpointing, *extra]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    if not expect_ok:
        assert result.returncode != 0
        return result.stderr
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    with open(out / "trainer_state.json") as handle:
        return [entry for entry in json.load(handle)["log_history"] if "loss" in entry]


def _assert_same_run(duplicated, shared):
    assert len(shared) == len(duplicated) == 2
    for plain, ours in zip(duplicated, shared, strict=True):
        assert ours["shared_prefix/token_ratio"] > 1.5  # the shared pass did run, on every chunk
        assert "shared_prefix/token_ratio" not in plain
        assert ours["reward"] == plain["reward"]  # the same rollouts (the engine samples the same)
        for key in ("loss", "entropy", "grad_norm", "sampling/sampling_logp_difference/mean"):
            assert ours[key] == pytest.approx(plain[key], rel=1e-3, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.distributed
def test_shared_prefix_under_zero3_matches_the_duplicated_pass(tmp_path):
    """The example's default (LoRA), without gradient checkpointing."""
    _assert_same_run(_zero3_run(tmp_path, "false", port=29591), _zero3_run(tmp_path, "true", port=29592))


@pytest.mark.slow
@pytest.mark.distributed
def test_shared_prefix_under_zero3_with_gradient_checkpointing_matches_the_duplicated_pass(tmp_path):
    """Full fine-tuning with gradient checkpointing (transformers' default, non-reentrant): the cache passes through
    the checkpointed layers and ZeRO-3's re-gathers for the recompute give the duplicated pass's gradients."""
    extra = ("--use_peft", "false")
    duplicated = _zero3_run(tmp_path, "false", port=29594, checkpointing="true", extra=extra)
    shared = _zero3_run(tmp_path, "true", port=29595, checkpointing="true", extra=extra)
    _assert_same_run(duplicated, shared)
    assert shared[1]["grad_norm"] > 0.05  # real gradients are compared (not two zero updates)


@pytest.mark.slow
@pytest.mark.distributed
def test_shared_prefix_true_is_refused_for_peft_under_zero3_with_gradient_checkpointing(tmp_path):
    stderr = _zero3_run(tmp_path, "true", port=29593, checkpointing="true", expect_ok=False)
    assert "shared_prefix='true' cannot run: TRL forces reentrant gradient checkpointing for a PEFT model" in stderr


@pytest.mark.distributed
def test_shared_prefix_under_fsdp2_matches_the_duplicated_pass(tmp_path):
    """FSDP2 (raw fully_shard on gloo, 2 processes: Accelerate runs FSDP only on accelerators), full fine-tuning and
    LoRA, with and without gradient checkpointing: the shared pass's log-probs and full gradients equal the duplicated
    pass's (fp32: log-probs within 1e-4, gradients within 1e-5 of their norm); a chunk that repeats its prompts on one
    rank only goes through the duplicated pass on both (tests/distributed/shared_prefix_fsdp2.py)."""
    report = run_torchrun_report("shared_prefix_fsdp2.py", tmp_path / "fsdp2.json", port=29596)
    assert sorted(report) == ["full", "full_checkpointing", "lora", "lora_checkpointing"]
    for name, result in report.items():
        assert result["decisions"] == [[True, False], [True, False]], name
        assert result["trainable_tensors"] == (29 if name.startswith("full") else 42), name
        assert result["grad_norm"] > 1.0, name  # real gradients are compared
        assert result["max_logp_difference"] < 1e-4, name
        assert result["max_grad_difference"] < 1e-5 * result["grad_norm"], name
