"""GPU only: the GRPO trainer's shared-prefix pass under Accelerate's FSDP2 (which runs only on accelerators; on CPU
tests/test_shared_prefix_sharded.py checks the pass under raw fully_shard) logs the duplicated pass's losses."""

import json
import os

import pytest
import torch

from ..helpers.launch import ACCELERATE_LAUNCH, REPO_ROOT, run_command

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: this machine has none"),
]


def _fsdp2_run(tmp_path, shared_prefix: str) -> list[dict]:
    from trlx_scale.launch_config import LaunchPlan

    config = tmp_path / "fsdp2_1gpu.yaml"
    config.write_text(LaunchPlan(nodes=1, gpus_per_node=1, backend="fsdp2").to_yaml())
    out = tmp_path / shared_prefix
    command = [*ACCELERATE_LAUNCH, "--config_file", str(config), "--num_processes", "1"]
    command += [os.path.join(REPO_ROOT, "examples", "grpo.py"), "--use_vllm", "false", "--max_steps", "2"]
    command += ["--eval_size", "0", "--logging_steps", "1", "--per_device_train_batch_size", "32"]
    command += ["--shared_prefix", shared_prefix, "--output_dir", str(out)]
    run_command(command, timeout=900)
    with open(out / "trainer_state.json") as handle:
        return [entry for entry in json.load(handle)["log_history"] if "loss" in entry]


def test_shared_prefix_under_accelerate_fsdp2_matches_the_duplicated_pass(tmp_path):
    duplicated = _fsdp2_run(tmp_path, "false")
    shared = _fsdp2_run(tmp_path, "true")
    assert len(shared) == len(duplicated) == 2
    for plain, ours in zip(duplicated, shared, strict=True):
        assert ours["shared_prefix/token_ratio"] > 1.5  # the shared pass ran
        assert ours["reward"] == plain["reward"]  # the same rollouts
        for key in ("loss", "entropy", "grad_norm"):  # bf16 compute: summation order moves the last digits
            assert ours[key] == pytest.approx(plain[key], rel=2e-2, abs=1e-4), key
