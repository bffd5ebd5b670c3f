"""Optimizer presets tuned for RL and preference learning.

RL updates are tiny (lr 1e-6 to 1e-7) and the loss surface moves with the policy, so the presets use a short warmup,
a constant schedule, and beta2 = 0.95: Adam's second-moment memory is then about 1 / (1 - 0.95) = 20 steps instead
of 1000, so the step size follows the current gradient scale rather than one from hundreds of policies ago.

A preset fills only the fields the user left at their default (a field counts as set when its value differs from
the config class's default), and the trainer logs the effective values at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config_defaults import fill_unset_fields


@dataclass(frozen=True)
class OptimizerPreset:
    """Hyperparameters one preset sets; names are the `TrainingArguments` fields they fill."""

    name: str
    learning_rate: float
    warmup_steps: int
    lr_scheduler_type: str
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    weight_decay: float
    max_grad_norm: float
    description: str

    def training_arguments(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in PRESET_FIELDS}


PRESET_FIELDS = (
    "learning_rate",
    "warmup_steps",
    "lr_scheduler_type",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "weight_decay",
    "max_grad_norm",
)

_RL_COMMON = dict(
    warmup_steps=20,
    lr_scheduler_type="constant_with_warmup",
    adam_beta1=0.9,
    adam_beta2=0.95,
    adam_epsilon=1e-8,
    weight_decay=0.0,
    max_grad_norm=1.0,
)

PRESETS: dict[str, OptimizerPreset] = {
    "grpo": OptimizerPreset(
        "grpo", learning_rate=1e-6, description="GRPO/GSPO policy, full fine-tuning", **_RL_COMMON
    ),
    "ppo_policy": OptimizerPreset("ppo_policy", learning_rate=1e-6, description="PPO actor", **_RL_COMMON),
    "ppo_critic": OptimizerPreset("ppo_critic", learning_rate=1e-6, description="PPO value model", **_RL_COMMON),
    "dpo": OptimizerPreset(
        "dpo", learning_rate=5e-7, description="DPO (offline and online)", **{**_RL_COMMON, "warmup_steps": 50}
    ),
    # LoRA adapters start at zero and are scaled by alpha / r, so the same displacement of the effective weight needs
    # a larger step on the adapter; LoRA RL recipes report optimal learning rates about 10x those of full
    # fine-tuning, which this variant applies.
    "grpo_lora": OptimizerPreset(
        "grpo_lora", learning_rate=1e-5, description="GRPO/GSPO policy trained through LoRA adapters", **_RL_COMMON
    ),
}


def get_preset(name: str) -> OptimizerPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"optim_preset must be one of {sorted(PRESETS)}, got {name!r}.") from None


def apply_preset(config: Any, preset: OptimizerPreset) -> dict[str, tuple[Any, str]]:
    """Fill ``config``'s optimizer fields that still hold their class default with the preset's values.

    Returns ``{field: (effective value, "preset" | "user")}`` for the log line the trainer prints.
    """
    return fill_unset_fields(config, preset.training_arguments(), source="preset")


def describe(effective: dict[str, tuple[Any, str]], preset: OptimizerPreset) -> str:
    parts = [
        f"{name}={value!r}{'' if source == 'preset' else ' (user)'}" for name, (value, source) in effective.items()
    ]
    return f"optimizer preset {preset.name!r} ({preset.description}): " + ", ".join(parts)
