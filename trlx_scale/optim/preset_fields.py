"""``OptimizerPresetFields``: ``optim_preset`` and ``fp32_master_weights``, the config fields of the optimizer presets,
shared by every trainer's config."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..trl_config_upgrade import registers_options
from .presets import PRESETS, apply_preset, get_preset


@registers_options(derived={"optim_preset_values": None})
@dataclass
class OptimizerPresetFields:
    """`optim_preset` and `fp32_master_weights` (trlx_scale.optim)."""

    optim_preset: str | None = field(
        default=None,
        metadata={
            "help": "Optimizer hyperparameters tuned for RL: 'grpo', 'grpo_lora', 'ppo_policy', 'ppo_critic', 'dpo' "
            "(AdamW, constant schedule with warmup, betas (0.9, 0.95); docs/optimizers.md). Fills only the optimizer "
            "fields left at their defaults; the effective values are printed at start.",
            "choices": [None, *sorted(PRESETS)],
        },
    )
    fp32_master_weights: bool | None = field(
        default=None,
        metadata={
            "help": "Hold the model in bf16 (compute and the weights sent to vLLM) and keep fp32 master weights and "
            "fp32 Adam moments in the optimizer, so that tiny RL updates are not rounded away. Unset: on when "
            "optim_preset is set. Under FSDP2/ZeRO-3 the sharding engine keeps the masters (docs/optimizers.md)."
        },
    )

    @property
    def uses_fp32_master_weights(self) -> bool:
        return self.optim_preset is not None if self.fp32_master_weights is None else self.fp32_master_weights

    def apply_optim_preset(self) -> None:
        """Fill the optimizer fields left at their defaults from ``optim_preset``; ``optim_preset_values`` records
        each effective value and its source for the trainer's start-up line. Call before TrainingArguments'
        ``__post_init__``, which turns some of these fields into enums."""
        self.optim_preset_values: dict | None = None
        if self.optim_preset is not None:
            self.optim_preset_values = apply_preset(self, get_preset(self.optim_preset))
