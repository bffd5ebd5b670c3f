"""Optimizer presets and fp32 master weights on a trlx_scale trainer (GRPO, PPO, DPO): one component for all.

A trainer holds one ``MasterWeights`` (``trlx_scale.trainer_features`` builds it after TRL's ``__init__``); its
``create_optimizer`` override asks it for the optimizer when fp32 masters live in trlx_scale's optimizer.
"""

from __future__ import annotations

from typing import Any

import torch

from ..trainer_part import TrainerPart
from .master_weights import FP32MasterAdamW, cast_for_master_weights
from .presets import describe, get_preset


class MasterWeights(TrainerPart):
    """``optim_preset`` reporting, bf16 model + ``FP32MasterAdamW`` on a single device / DDP."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        args = trainer.args
        if args.optim_preset_values is not None:
            trainer.accelerator.print(describe(args.optim_preset_values, get_preset(args.optim_preset)))
        if not args.uses_fp32_master_weights:
            return
        if trainer.optimizer is not None:
            raise ValueError(
                "fp32_master_weights builds its own optimizer (FP32MasterAdamW) but an optimizer was passed through "
                "`optimizers=`; drop one of the two (set fp32_master_weights=False to keep yours)."
            )
        if trainer.is_deepspeed_enabled:
            ds_config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
            if not ds_config.get("bf16", {}).get("enabled", False):
                raise ValueError(
                    "fp32_master_weights under DeepSpeed needs its bf16 mode (fp32 masters in the optimizer): set "
                    '"bf16": {"enabled": true} in the DeepSpeed config, e.g. trlx_scale.optim.deepspeed_zero3_config.'
                )
            return
        if trainer.is_fsdp_enabled:
            return  # FSDP2 keeps fp32 sharded masters; bf16 compute comes from its MixedPrecisionPolicy
        cast_for_master_weights(trainer.model, torch.bfloat16)
        trainer.accelerator.print("fp32_master_weights: model held in bf16, fp32 masters and moments in the optimizer")

    @property
    def builds_optimizer(self) -> bool:
        """fp32 masters in our optimizer: single device and DDP (FSDP2/ZeRO-3 keep their own masters)."""
        trainer = self.trainer
        uses = trainer.args.uses_fp32_master_weights
        return uses and not (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled)

    def create_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """``FP32MasterAdamW`` over ``model``'s trainable parameters, with transformers' weight-decay groups."""
        trainer = self.trainer
        args = trainer.args
        decay = set(trainer.get_decay_parameter_names(model))
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in trainable if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
        ]
        return FP32MasterAdamW(
            [g for g in groups if g["params"]],
            lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
        )
