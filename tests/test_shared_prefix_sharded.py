"""The shared-prefix pass under DeepSpeed ZeRO-3 (2 CPU processes through `accelerate launch`): the ranks agree per
chunk (one all-reduce), so shared_prefix='true' runs where it used to be refused, and a run with it logs the same
losses and gradient norms as the duplicated pass up to float rounding (without gradient checkpointing: with it,
ZeRO-3 gives the shared pass wrong gradients, so it is refused there with the reason)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from .helpers.launch import ACCELERATE, LAUNCH_VARIABLES, REPO_ROOT

EXAMPLE = os.path.join(REPO_ROOT, "examples", "grpo.py")


def _zero3_run(tmp_path, shared_prefix: str, port: int, checkpointing: str = "false", expect_ok: bool = True):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    for name in LAUNCH_VARIABLES:
        env.pop(name, None)
    out = tmp_path / shared_prefix
    config = os.path.join(REPO_ROOT, "configs", "accelerate", "cpu_zero3.yaml")
    command = [ACCELERATE, "launch", "--config_file", config, "--main_process_port", str(port), EXAMPLE]
    command += ["--max_steps", "2", "--eval_size", "0", "--logging_steps", "1", "--output_dir", str(out)]
    command += ["--per_device_train_batch_size", "32", "--shared_prefix", shared_prefix]
    command += ["--gradient_checkpointing", checkpointing]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    if not expect_ok:
        assert result.returncode != 0
        return result.stderr
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    with open(out / "trainer_state.json") as handle:
        return [entry for entry in json.load(handle)["log_history"] if "loss" in entry]


@pytest.mark.slow
@pytest.mark.distributed
def test_shared_prefix_under_zero3_matches_the_duplicated_pass(tmp_path):
    duplicated = _zero3_run(tmp_path, "false", port=29591)
    shared = _zero3_run(tmp_path, "true", port=29592)
    assert len(shared) == len(duplicated) == 2
    for plain, ours in zip(duplicated, shared, strict=True):
        assert ours["shared_prefix/token_ratio"] > 1.5  # the shared pass did run, on every chunk
        assert "shared_prefix/token_ratio" not in plain
        assert ours["reward"] == plain["reward"]  # the same rollouts (the engine samples the same)
        for key in ("loss", "entropy", "grad_norm", "sampling/sampling_logp_difference/mean"):
            assert ours[key] == pytest.approx(plain[key], rel=1e-3, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.distributed
def test_shared_prefix_true_is_refused_under_zero3_with_gradient_checkpointing(tmp_path):
    stderr = _zero3_run(tmp_path, "true", port=29593, checkpointing="true", expect_ok=False)
    assert (
        "shared_prefix='true' cannot run: gradient checkpointing under DeepSpeed gives the shared pass wrong" in stderr
    )
