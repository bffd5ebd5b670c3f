"""LoRA-only weight sync from an FSDP2-sharded policy (raw fully_shard on gloo: Accelerate runs FSDP only on
accelerators)."""

import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO_ROOT


@pytest.mark.distributed
def test_fsdp2_sharded_lora_policy_sends_the_full_adapter(tmp_path):
    """FSDP2 (raw fully_shard, gloo, 2 processes): each rank holds half of every LoRA tensor; the adapter vLLM gets is
    the unsharded one, and only LoRA tensors are gathered (bytes sent = adapter size)."""
    report_path = tmp_path / "lora.json"
    script = os.path.join(REPO_ROOT, "tests", "distributed", "fsdp2_lora_gather.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29534"]
    result = subprocess.run(
        [*command, script, str(report_path)], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["lora_params_sharded"] and 0.4 < report["local_fraction"] < 0.6
    assert report["same_keys"] and report["max_abs_diff"] == 0.0
    assert report["bytes_sent"] == report["adapter_bytes"]
