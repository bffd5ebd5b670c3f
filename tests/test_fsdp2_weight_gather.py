"""LoRA-only weight sync from an FSDP2-sharded policy (raw fully_shard on gloo: Accelerate runs FSDP only on
accelerators)."""

import pytest

from .helpers.launch import run_torchrun_report


@pytest.mark.distributed
def test_fsdp2_sharded_lora_policy_sends_the_full_adapter(tmp_path):
    """FSDP2 (raw fully_shard, gloo, 2 processes): each rank holds half of every LoRA tensor; the adapter vLLM gets is
    the unsharded one, and only LoRA tensors are gathered (bytes sent = adapter size)."""
    report = run_torchrun_report("fsdp2_lora_gather.py", tmp_path / "lora.json", port=29534)
    assert report["lora_params_sharded"] and 0.4 < report["local_fraction"] < 0.6
    assert report["same_keys"] and report["max_abs_diff"] == 0.0
    assert report["bytes_sent"] == report["adapter_bytes"]


@pytest.mark.distributed
def test_fsdp2_sharded_full_policy_streams_unsharded_weights(tmp_path):
    """FSDP2 full fine-tuning: the bucketed stream gathers each DTensor and sends the unsharded weights in the engine
    dtype (bf16 here), nothing more."""
    report = run_torchrun_report("fsdp2_full_gather.py", tmp_path / "full.json", port=29535)
    assert report["sharded"] and report["same_names"] and report["all_full_shape"]
    assert report["max_abs_diff_bf16"] == 0.0 and report["dtypes"] == ["torch.bfloat16"]
    assert report["bytes"] == report["expected_bytes"]
