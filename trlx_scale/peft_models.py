"""What kind of model a trainer holds: a PEFT (LoRA) policy or a plain one.

Read by the engine (LoRA-only sync), the trainers (a LoRA policy's reference is its base) and the passes; it lives
below all of them so none imports another for it.
"""

from __future__ import annotations

import torch


def is_peft_model(model: torch.nn.Module) -> bool:
    """A PEFT model (``PeftModel``): it has adapters and a base to return to. Duck-typed so that PEFT need not be
    imported to ask (a run without PEFT never loads it)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")
