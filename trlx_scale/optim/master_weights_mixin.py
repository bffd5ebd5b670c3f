"""Optimizer presets and fp32 master weights on a trlx_scale trainer (GRPO, PPO, DPO): one implementation for all.

A trainer feature (``trlx_scale.trainer_features``): its ``_setup_master_weights`` runs in the trainer's one
post-init step, ``_setup_features``.
"""

from __future__ import annotations

import torch

from ..options import option
from .master_weights import FP32MasterAdamW, cast_for_master_weights
from .preset_fields import uses_fp32_master_weights
from .presets import describe, get_preset


class MasterWeightsMixin:
    """``optim_preset`` reporting, bf16 model + ``FP32MasterAdamW`` on a single device / DDP."""

    @property
    def _uses_master_optimizer(self) -> bool:
        """fp32 masters in our optimizer: single device and DDP (FSDP2/ZeRO-3 keep their own masters)."""
        uses = uses_fp32_master_weights(self.args)
        return uses and not (self.is_deepspeed_enabled or self.is_fsdp_enabled)

    def _setup_master_weights(self) -> None:
        args = self.args
        if option(args, "optim_preset_values") is not None:
            self.accelerator.print(describe(args.optim_preset_values, get_preset(args.optim_preset)))
        if not uses_fp32_master_weights(args):
            return
        if self.optimizer is not None:
            raise ValueError(
                "fp32_master_weights builds its own optimizer (FP32MasterAdamW) but an optimizer was passed through "
                "`optimizers=`; drop one of the two (set fp32_master_weights=False to keep yours)."
            )
        if self.is_deepspeed_enabled:
            ds_config = self.accelerator.state.deepspeed_plugin.deepspeed_config
            if not ds_config.get("bf16", {}).get("enabled", False):
                raise ValueError(
                    "fp32_master_weights under DeepSpeed needs its bf16 mode (fp32 masters in the optimizer): set "
                    '"bf16": {"enabled": true} in the DeepSpeed config, e.g. trlx_scale.optim.deepspeed_zero3_config.'
                )
            return
        if self.is_fsdp_enabled:
            return  # FSDP2 keeps fp32 sharded masters; bf16 compute comes from its MixedPrecisionPolicy
        cast_for_master_weights(self.model, torch.bfloat16)
        self.accelerator.print("fp32_master_weights: model held in bf16, fp32 masters and moments in the optimizer")

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if not self._uses_master_optimizer:
            return super().create_optimizer(model)
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            decay = set(self.get_decay_parameter_names(opt_model))
            trainable = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in trainable if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
            ]
            self.optimizer = FP32MasterAdamW(
                [g for g in groups if g["params"]],
                lr=self.args.learning_rate,
                betas=(self.args.adam_beta1, self.args.adam_beta2),
                eps=self.args.adam_epsilon,
            )
        return self.optimizer
