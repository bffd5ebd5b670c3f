"""PPO under DeepSpeed ZeRO-3 on 2 CPU processes (`accelerate launch`, gloo): every role is partitioned like the policy
(each rank holds about half of the critic's parameters, fp32 masters and Adam moments, and of the reference model),
the shared-base critic trains as a parameter group of the policy's engine, and a run resumes its critic from a
checkpoint (the resumed step logs the same loss). The numbers match 1 process in test_process_count_equivalence.py."""

from __future__ import annotations

import json
import os

import pytest

from .helpers.launch import ACCELERATE, REPO_ROOT, run_command

SCRIPT = os.path.join(REPO_ROOT, "tests", "distributed", "ppo_zero3_partitions.py")
CONFIG = os.path.join(REPO_ROOT, "configs", "accelerate", "cpu_zero3.yaml")


def _run(kind: str, out, port: int) -> list[dict]:
    command = [ACCELERATE, "launch", "--config_file", CONFIG, "--main_process_port", str(port), SCRIPT, kind, str(out)]
    run_command(command, timeout=900)
    reports = []
    for rank in range(2):
        with open(out / f"rank{rank}.json") as handle:
            reports.append(json.load(handle))
    return reports


def _about_half(held: dict) -> bool:
    """This rank's partition is half of the full size (DeepSpeed pads each parameter to a multiple of 2)."""
    return 0 < held["full"] and abs(held["local"] - held["full"] / 2) <= held.get("padding", 0) + 64


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("kind", "port"), [("separate", 29721), ("full", 29722), ("shared_base", 29723)])
def test_ppo_roles_are_partitioned_under_zero3(kind, port, tmp_path):
    reports = _run(kind, tmp_path, port)
    for report in reports:
        assert report["world_size"] == 2
        assert _about_half(report["critic"]), report["critic"]
        assert _about_half(report["policy"]), report["policy"]
        # Resuming from checkpoint-1 (the DeepSpeed critic's partitions, or the shared-base critic in the policy's
        # engine) retrains step 2 to the same loss.
        assert report["resumed_losses"] == report["losses"] and len(report["losses"]) == 2
    if kind == "shared_base":
        assert reports[0]["critic_group_lr"] == 1e-3 and reports[0]["policy_group_lr"] == 1e-4
        return
    for report in reports:
        assert report["critic_backend"] == "deepspeed"
        # The full critic trains every parameter: its fp32 masters are this rank's partition, Adam keeps two moments.
        assert report["critic_optimizer"]["masters"] == report["critic"]["local"]
        assert report["critic_optimizer"]["moments"] == 2 * report["critic_optimizer"]["masters"]
        assert "critic_deepspeed" in report["checkpoint_files"]
    assert reports[0]["critic"]["local"] + reports[1]["critic"]["local"] >= reports[0]["critic"]["full"]
    if kind == "full":
        for report in reports:
            assert _about_half(report["reference"]), report["reference"]
