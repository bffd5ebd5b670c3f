"""Optimizer presets: values, user-set fields winning, CLI reachability."""

import pytest
from trl import TrlParser

from trlx_scale import GRPOConfig
from trlx_scale.optim.presets import PRESETS, get_preset


def _config(tmp_path, **kwargs):
    return GRPOConfig(output_dir=str(tmp_path), bf16=False, report_to="none", **kwargs)


def test_preset_table_matches_the_spec():
    expected = {  # name: (lr, warmup) ; the rest is shared
        "grpo": (1e-6, 20),
        "ppo_policy": (1e-6, 20),
        "ppo_critic": (1e-6, 20),
        "dpo": (5e-7, 50),
        "grpo_lora": (1e-5, 20),
    }
    assert set(PRESETS) == set(expected)
    for name, (lr, warmup) in expected.items():
        preset = PRESETS[name]
        assert (preset.learning_rate, preset.warmup_steps) == (lr, warmup)
        assert preset.lr_scheduler_type == "constant_with_warmup"
        assert (preset.adam_beta1, preset.adam_beta2, preset.adam_epsilon) == (0.9, 0.95, 1e-8)
        assert (preset.weight_decay, preset.max_grad_norm) == (0.0, 1.0)


def test_preset_fills_defaults_and_user_values_win(tmp_path):
    args = _config(tmp_path, optim_preset="dpo", learning_rate=3e-6)
    assert args.learning_rate == 3e-6  # user
    assert args.warmup_steps == 50 and args.adam_beta2 == 0.95  # preset
    assert str(args.lr_scheduler_type.value) == "constant_with_warmup"
    assert args.optim_preset_values["learning_rate"] == (3e-6, "user")
    assert args.optim_preset_values["adam_beta2"] == (0.95, "preset")
    assert args.uses_fp32_master_weights and args.engine_dtype() == "bfloat16"  # default "trainer": the bf16 model
    assert _config(tmp_path, optim_preset="grpo", vllm_dtype="trainer").engine_dtype() == "bfloat16"


def test_no_preset_changes_nothing(tmp_path):
    args = _config(tmp_path)
    assert args.optim_preset_values is None and not args.uses_fp32_master_weights
    assert args.adam_beta2 == 0.999 and args.learning_rate == 1e-6


def test_unknown_preset_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"optim_preset must be one of \['dpo', 'grpo'"):
        get_preset("adamw_rl")
    with pytest.raises(ValueError, match="optim_preset must be one of"):
        _config(tmp_path, optim_preset="adamw_rl")


def test_preset_is_a_cli_flag(tmp_path):
    (args,) = TrlParser((GRPOConfig,)).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--bf16", "false", "--optim_preset", "grpo", "--fp32_master_weights", "false"]
    )
    assert args.optim_preset == "grpo" and args.adam_beta2 == 0.95 and not args.uses_fp32_master_weights
