"""fp32 masters under sharded data parallelism: FSDP2 (real, 2 gloo processes) and the DeepSpeed ZeRO-3 config."""

import json
import os

import pytest

from trlx_scale.optim.distributed_precision import deepspeed_zero3_config
from trlx_scale.optim.presets import PRESETS

from .helpers.launch import REPO_ROOT, run_torchrun_report


@pytest.mark.distributed
def test_fsdp2_keeps_fp32_sharded_masters_with_bf16_compute(tmp_path):
    report = run_torchrun_report("fsdp2_master_weights.py", tmp_path / "report.json", port=29533)
    assert report["is_dtensor"] and report["sharded_dtypes"] == ["torch.float32"]
    assert report["local_rows"] == [32, 32]  # each rank holds half of each 64-row weight
    assert report["output_dtypes"] == ["torch.bfloat16"]
    # 50 steps of ~1e-6 each: every fp32 master moved, by ~5e-5. That is below bf16's spacing at magnitude 1
    # (2**-7), so only weights that sat next to a rounding boundary (~2 * 5e-5 / 2**-7, about 1%) show it in bf16:
    # a model held in bf16 without masters would have kept all of them.
    assert 1e-5 < report["mean_master_change"] < 1e-4
    assert report["fraction_master_changed"] > 0.95
    assert report["fraction_bf16_changed"] < 0.05


def test_deepspeed_config_uses_bf16_with_fp32_masters_and_the_preset():
    config = deepspeed_zero3_config(PRESETS["grpo"], offload_optimizer=True)
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert config["data_types"]["grad_accum_dtype"] == "fp32" and config["communication_data_type"] == "fp32"
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    params = config["optimizer"]["params"]
    assert params["lr"] == 1e-6 and params["betas"] == [0.9, 0.95] and config["gradient_clipping"] == 1.0


@pytest.mark.parametrize("offload", [False, True])
def test_committed_deepspeed_configs_are_generated(offload):
    name = "zero3_bf16_master_offload.json" if offload else "zero3_bf16_master.json"
    with open(os.path.join(REPO_ROOT, "configs", "deepspeed", name)) as handle:
        committed = json.load(handle)
    assert committed == deepspeed_zero3_config(PRESETS["grpo"], offload_optimizer=offload), (
        f"configs/deepspeed/{name} is stale: regenerate it with scripts/write_deepspeed_configs.py"
    )


def test_deepspeed_accepts_the_zero_section():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = {k: v for k, v in deepspeed_zero3_config(PRESETS["grpo"])["zero_optimization"].items() if v != "auto"}
    parsed = DeepSpeedZeroConfig(**zero)
    assert parsed.stage == 3 and parsed.gather_16bit_weights_on_model_save
