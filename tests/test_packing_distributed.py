"""Packed rows on 2 CPU processes through `accelerate launch` (DDP and DeepSpeed ZeRO-3): the GRPO example trains
with padding_free='true' as with 'false', losses and gradient norms equal up to float rounding, with the packed
run's samples also dealt to the ranks by cost where that pays (balance_ranks='auto').

A small ``max_tokens_per_microbatch`` cuts each rank's passes into several forwards, and the ranks' counts can differ
(their completions differ): under ZeRO-3 every forward gathers the weights with collectives, so this run only ends if
the ranks with fewer forwards run the dummy ones (passes.packed); a missing one hangs until the timeout."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from .helpers.launch import ACCELERATE_LAUNCH, REPO_ROOT, launch_env

EXAMPLE = os.path.join(REPO_ROOT, "examples", "grpo.py")


def _run(tmp_path, config: str, padding_free: str, port: int) -> list[dict]:
    out = tmp_path / f"{config}-{padding_free}"
    command = [*ACCELERATE_LAUNCH, "--config_file", os.path.join(REPO_ROOT, "configs", "accelerate", config)]
    # 8 held-out prompts: the accuracy is not what is compared (0 would score the embedded task's whole split).
    command += ["--main_process_port", str(port), EXAMPLE, "--max_steps", "2", "--eval_size", "8"]
    command += ["--logging_steps", "1", "--output_dir", str(out), "--per_device_train_batch_size", "16"]
    command += [
        "--padding_free",
        padding_free,
        "--shared_prefix",
        "false",
        "--max_tokens_per_microbatch",
        "24",
        "--max_completion_length",
        "12",
    ]
    env = dict(launch_env(), VLLM_CPU_KVCACHE_SPACE="1")
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    with open(out / "trainer_state.json") as handle:
        return [entry for entry in json.load(handle)["log_history"] if "loss" in entry]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("config", "ports"), [("cpu_ddp.yaml", (29651, 29652)), ("cpu_zero3.yaml", (29653, 29654))])
def test_two_processes_train_packed_like_padded(tmp_path, config, ports):
    padded = _run(tmp_path, config, "false", ports[0])
    packed = _run(tmp_path, config, "true", ports[1])
    assert len(packed) == len(padded) == 2
    for plain, ours in zip(padded, packed, strict=True):
        assert ours["reward"] == plain["reward"]  # the same rollouts
        assert ours["batch/pad_frac"] <= plain["batch/pad_frac"]  # (the example's completions are of similar lengths)
        # DDP: the budget cuts the loss pass into forwards. ZeRO-3 with TRL's reentrant checkpointing for LoRA: one
        # forward with gradients (passes.packed), the no-grad passes still cut.
        forwards = ours["batch/forwards_per_microbatch"]
        assert forwards == 1 if "zero3" in config else forwards > 1
        # recompute_forwards='auto' under the budget: DDP's several forwards are recomputed in the backward (one
        # reduction per parameter still: the backward is one autograd pass); ZeRO-3's one forward is not.
        assert ours["batch/recomputed_forwards"] == (0 if "zero3" in config else forwards)
        # balance_ranks='auto' deals the packed run's samples to the ranks by cost where that lowers the costliest
        # rank's cost (the padded run keeps TRL's placement): the loss and the gradient are the same wherever a
        # sample sits (a run where samples really move: tests/test_rank_balance.py).
        assert ours["batch/rank_imbalance_after_balance"] <= ours["batch/rank_imbalance_before_balance"]
        assert "batch/rank_imbalance_after_balance" not in plain
        for key in ("loss", "entropy", "grad_norm"):
            assert ours[key] == pytest.approx(plain[key], rel=1e-3, abs=1e-6), key
