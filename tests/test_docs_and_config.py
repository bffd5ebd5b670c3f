"""Config fields (validation, CLI flags) and the generated configuration reference."""

import os

import pytest
import torch
from trl import TrlParser

from trlx_scale import GRPOConfig, config_reference

from .helpers.launch import REPO_ROOT


def test_configuration_reference_is_up_to_date():
    with open(os.path.join(REPO_ROOT, "docs", "configuration.md")) as handle:
        committed = handle.read()
    assert committed == config_reference.render(), (
        "docs/configuration.md is stale: run `python -m trlx_scale.config_reference > docs/configuration.md`"
    )


def test_reference_does_not_depend_on_a_parser_having_run():
    """HfArgumentParser rewrites dataclass Field.type in place when it builds a parser; the reference must not see it."""
    TrlParser((GRPOConfig,))
    with open(os.path.join(REPO_ROOT, "docs", "configuration.md")) as handle:
        assert handle.read() == config_reference.render()


def test_reference_lists_every_field():
    text = config_reference.render()
    import dataclasses

    for field in dataclasses.fields(GRPOConfig):
        assert f"| `{field.name}` |" in text, field.name


@pytest.mark.parametrize(
    ("flags", "expected"),
    [({}, "float32"), ({"bf16": True, "use_cpu": True}, "bfloat16"), ({"fp16": False, "bf16": False}, "float32")],
)
def test_engine_dtype_follows_the_trainer(tmp_path, flags, expected):
    args = GRPOConfig(output_dir=str(tmp_path), vllm_dtype="trainer", **{"bf16": False, **flags})
    assert args.engine_dtype() == expected
    # The default is "trainer" (chosen by measurement, docs/benchmarks.md); "auto" is vLLM's choice, TRL's behaviour.
    assert GRPOConfig(output_dir=str(tmp_path), bf16=False).engine_dtype() == "float32"
    assert GRPOConfig(output_dir=str(tmp_path), bf16=False, vllm_dtype="auto").engine_dtype() == "auto"
    # A model loaded in bf16 computes in bf16 without mixed precision: the engine follows it instead of upcasting.
    assert GRPOConfig(output_dir=str(tmp_path), bf16=False).engine_dtype(torch.bfloat16) == "bfloat16"


def test_bad_values_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="vllm_dtype must be one of"):
        GRPOConfig(output_dir=str(tmp_path), bf16=False, vllm_dtype="fp8")
    with pytest.raises(ValueError, match="vllm_cpu_kvcache_space must be a positive"):
        GRPOConfig(output_dir=str(tmp_path), bf16=False, vllm_cpu_kvcache_space=0)


def test_new_fields_are_cli_flags(tmp_path):
    parser = TrlParser((GRPOConfig,))
    (args,) = parser.parse_args_and_config(
        ["--output_dir", str(tmp_path), "--bf16", "false", "--vllm_dtype", "trainer", "--vllm_enforce_eager", "true"]
    )
    assert args.vllm_dtype == "trainer" and args.vllm_enforce_eager is True
