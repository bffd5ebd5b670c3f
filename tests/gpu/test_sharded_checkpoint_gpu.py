"""GPU only: the trainers' checkpoints under Accelerate's FSDP2 with SHARDED_STATE_DICT (the shipped FSDP2 configs),
synchronous and asynchronous (``async_checkpoints``): per-rank DCP shards in Accelerate's layout, a completion
marker only once they are durable, a resume that continues the run, and a consolidated ``save_model`` for the Hub
and vLLM. (On CPU, where Accelerate runs no FSDP, tests/test_sharded_checkpoint.py checks the same saves under raw
fully_shard, with resharding and a kill mid-write.)"""

import json
import os
import shutil

import pytest
import torch

from ..helpers.launch import ACCELERATE_LAUNCH, REPO_ROOT, run_command

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: this machine has none"),
]


def _run(tmp_path, out, *extra) -> list[dict]:
    from trlx_scale.launch_config import LaunchPlan

    config = tmp_path / "fsdp2_1gpu.yaml"
    config.write_text(LaunchPlan(nodes=1, gpus_per_node=1, backend="fsdp2").to_yaml())
    command = [*ACCELERATE_LAUNCH, "--config_file", str(config), "--num_processes", "1"]
    command += [os.path.join(REPO_ROOT, "examples", "grpo.py"), "--use_vllm", "false", "--max_steps", "4"]
    command += ["--eval_size", "0", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2"]
    command += ["--output_dir", str(out), *extra]
    run_command(command, timeout=900)
    with open(out / "trainer_state.json") as handle:
        return [entry for entry in json.load(handle)["log_history"] if "loss" in entry]


@pytest.mark.parametrize("asynchronous", ["false", "true"])
def test_fsdp2_sharded_checkpoints_resume_and_save_model_is_consolidated(tmp_path, asynchronous):
    straight = _run(tmp_path, tmp_path / "straight", "--async_checkpoints", asynchronous)
    checkpoint = tmp_path / "straight" / "checkpoint-2"
    marker = json.loads((checkpoint / "trlx_scale_checkpoint_complete.json").read_text())
    assert any(name.startswith("pytorch_model_fsdp_0/") and name.endswith(".distcp") for name in marker["files"])
    assert any(name.startswith("optimizer_0/") for name in marker["files"])
    # save_model (the example's final save, what the Hub gets) is one consolidated adapter or model file.
    assert any((tmp_path / "straight" / name).is_file() for name in ("adapter_model.safetensors", "model.safetensors"))
    shutil.copytree(checkpoint, tmp_path / "resumed" / "checkpoint-2")
    resumed = _run(
        tmp_path, tmp_path / "resumed", "--async_checkpoints", asynchronous, "--resume_from_checkpoint", "true"
    )
    for plain, ours in zip(straight[2:], resumed[2:], strict=True):
        assert ours["loss"] == pytest.approx(plain["loss"], rel=2e-2, abs=1e-4)
