"""trlx_scale: TRL's trainers with the systems techniques of verl and OpenRLHF.

``from trlx_scale import GRPOTrainer, GRPOConfig`` (and ``DPOTrainer``, ``DPOConfig``; ``PPOTrainer``, ``PPOConfig`` replace TRL's removed PPO) is a drop-in replacement for
``from trl import ...``.

The names below are imported on first use (PEP 562), so that ``import trlx_scale.planning`` and the
``trlx-scale plan`` command do not pay for torch, TRL and vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .compat.known_warnings import silence_known_warnings

__version__ = "0.1.0"

silence_known_warnings()  # before anything imports TRL or vLLM (compat/known_warnings.py says which and why)

# public name -> module that defines it
_LAZY = {
    "DPOConfig": ".trainer",
    "DPOTrainer": ".trainer",
    "GRPOConfig": ".trainer",
    "GRPOTrainer": ".trainer",
    "PPOConfig": ".trainer",
    "PPOTrainer": ".trainer",
    "addition_dataset": ".data.addition",
    "addition_preference_dataset": ".data.addition",
    "exact_match_reward": ".data.addition",
    "default_model_path": ".models.default_model",
}

__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "PPOConfig",
    "PPOTrainer",
    "__version__",
    "addition_dataset",
    "addition_preference_dataset",
    "default_model_path",
    "exact_match_reward",
]

if TYPE_CHECKING:
    from .data.addition import addition_dataset, addition_preference_dataset, exact_match_reward
    from .models.default_model import default_model_path
    from .trainer import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
