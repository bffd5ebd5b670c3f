"""Shared by the FSDP2 pass scripts (raw ``fully_shard`` on gloo: Accelerate runs FSDP only on accelerators): the
embedded model sharded as Accelerate's FSDP2 shards it, in each of the variants they compare."""

from collections.abc import Callable

import torch
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from trlx_scale.tasks.default_model import default_model_path

VARIANTS = [("full", False), ("full", True), ("lora", False), ("lora", True)]  # (kind, layer checkpointing)


def build_fsdp2_model(kind: str, checkpointing: bool, shard: bool = True, **model_kwargs) -> torch.nn.Module:
    """The embedded model with TRL's fused LM head, fully trained (``kind="full"``) or a LoRA adapter whose B
    starts non-zero (so its gradients are not trivial), optionally with transformers' default (non-reentrant)
    gradient checkpointing, sharded as ``accelerate.utils.fsdp2_prepare_model`` does: each decoder layer a group,
    then the root (``shard=False``: the same model unsharded, the reference). The same initialisation on every rank."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32, **model_kwargs)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))  # as GRPOTrainer does, before PEFT
    layer_classes = set(model._no_split_modules or ())
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02)
    if checkpointing:
        model.gradient_checkpointing_enable()  # transformers' default: non-reentrant
    if shard:
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module)
        fully_shard(model)
    model.train()
    return model


def report_variants(compare: Callable[[str, bool], dict]) -> dict:
    """``compare(kind, checkpointing)`` for every variant, keyed "full", "full_checkpointing", "lora", ..."""
    return {f"{kind}{'_checkpointing' if ckpt else ''}": compare(kind, ckpt) for kind, ckpt in VARIANTS}
