"""``PPOTrainer``'s roles: the critic (a separate model or a second adapter on the policy's base), the frozen
reference, the critic's optimizer options (the ``ppo_critic`` preset), and what the memory planner is told of them.
How each role is distributed is in ``ppo_trainer``'s module docstring and docs/ppo.md.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM
from trl.models.utils import prepare_deepspeed, prepare_fsdp
from trl.trainer.utils import add_fused_lm_head

from ..optim.master_weights import FP32MasterAdamW
from ..optim.presets import get_preset
from ..peft_models import is_peft_model
from .critic import SeparateCritic, SharedBaseCritic


def build_critic(trainer: Any, value_model):
    args, policy = trainer.args, trainer._policy()
    device = trainer.accelerator.device
    if args.critic_mode == "shared_base":
        if value_model is not None or not is_peft_model(policy):
            raise ValueError(
                "critic_mode='shared_base' adds a critic adapter to a LoRA policy: pass peft_config (or a "
                "PeftModel) and no value_model, or use critic_mode='separate'."
            )
        return SharedBaseCritic(policy, policy.peft_config[policy.active_adapter]).to(device)
    if value_model is None:
        source = args.value_model_name_or_path or policy.config._name_or_path
        value_model = AutoModelForCausalLM.from_pretrained(source, dtype=critic_dtype(trainer))
    if args.critic_use_peft:
        if not is_peft_model(policy):
            raise ValueError("critic_use_peft reuses the policy's LoRA config: give the policy a peft_config.")
        from peft import get_peft_model

        value_model = get_peft_model(value_model, policy.peft_config[policy.active_adapter])
    if args.gradient_checkpointing:  # the critic's activations are a policy-sized cost: same recompute trade
        kwargs = args.gradient_checkpointing_kwargs or {"use_reentrant": False}
        value_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if args.critic_use_peft:
            value_model.enable_input_require_grads()  # a frozen embedding feeds the checkpointed LoRA layers
    return SeparateCritic(value_model).to(device)


def critic_dtype(trainer: Any) -> torch.dtype:
    """fp32, unless the policy trains bf16 weights with fp32 masters (``fp32_master_weights``): then the critic
    does the same (bf16 compute, ``FP32MasterAdamW``). Under DeepSpeed the engine's precision config rules; under
    FSDP the sharded parameters are the fp32 masters and the mixed-precision policy computes in bf16."""
    if trainer.is_fsdp_enabled:
        return torch.float32
    if trainer.args.uses_fp32_master_weights and trainer._policy().dtype != torch.float32:
        return trainer._policy().dtype
    return torch.float32


def build_reference(trainer: Any, ref_model):
    """None for a LoRA policy (its base, adapters disabled, is the reference); else a frozen copy."""
    if is_peft_model(trainer._policy()):
        if ref_model is not None:
            raise ValueError("A LoRA policy's reference is its base (adapter disabled): drop ref_model.")
        return None
    if ref_model is None:
        ref_model = AutoModelForCausalLM.from_pretrained(
            trainer._policy().config._name_or_path, dtype=trainer._policy().dtype
        )
    add_fused_lm_head(ref_model, temperature=trainer.temperature)
    ref_model.requires_grad_(False).eval()
    # Inference-only, prepared as TRL prepares its own reference model: ZeRO-3 partitions it, FSDP shards it.
    if trainer.is_deepspeed_enabled:
        return prepare_deepspeed(ref_model, trainer.accelerator)
    if trainer.is_fsdp_enabled:
        return prepare_fsdp(ref_model, trainer.accelerator)
    return trainer.accelerator.prepare_model(ref_model, evaluation_mode=True)


def critic_optimizer_options(trainer: Any) -> dict:
    preset = get_preset("ppo_critic")
    return {
        "lr": trainer.args.critic_learning_rate or preset.learning_rate,
        "betas": (preset.adam_beta1, preset.adam_beta2),
        "eps": preset.adam_epsilon,
        "weight_decay": preset.weight_decay,
    }


def build_critic_optimizer(trainer: Any) -> torch.optim.Optimizer:
    params = trainer.critic.trainable_parameters()
    if any(p.dtype != torch.float32 for p in params) and not trainer.is_deepspeed_enabled:
        return FP32MasterAdamW(params, **critic_optimizer_options(trainer))
    return torch.optim.AdamW(params, **critic_optimizer_options(trainer))
