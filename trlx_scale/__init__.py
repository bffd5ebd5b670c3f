"""trlx_scale: TRL's trainers with the systems techniques of verl and OpenRLHF.

``from trlx_scale import GRPOTrainer, GRPOConfig`` (and ``DPOTrainer``, ``DPOConfig``; ``PPOTrainer``, ``PPOConfig`` replace TRL's removed PPO) is a drop-in replacement for
``from trl import ...``; ``AsyncGRPOTrainer``, ``AsyncGRPOConfig`` for TRL's experimental asynchronous GRPO.

The names below are imported on first use (PEP 562), so that ``import trlx_scale.planning`` and the
``trlx-scale plan`` command do not pay for torch, TRL and vLLM.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING

from .compat.known_warnings import silence_known_warnings

__version__ = "0.1.0"

silence_known_warnings()  # before anything imports TRL or vLLM (compat/known_warnings.py says which and why)

# public name -> module that defines it
_LAZY = {
    "AsyncGRPOConfig": ".trainer",
    "AsyncGRPOTrainer": ".trainer",
    "DPOConfig": ".trainer",
    "DPOTrainer": ".trainer",
    "GRPOConfig": ".trainer",
    "GRPOTrainer": ".trainer",
    "PPOConfig": ".trainer",
    "PPOTrainer": ".trainer",
}
# The demo harness moved to trlx_scale.tasks (0.2); these names keep working with a warning until 0.3.
_MOVED_TO_TASKS = ("addition_dataset", "addition_preference_dataset", "default_model_path", "exact_match_reward")

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "PPOConfig",
    "PPOTrainer",
    "__version__",
]

if TYPE_CHECKING:
    from .trainer import (
        AsyncGRPOConfig,
        AsyncGRPOTrainer,
        DPOConfig,
        DPOTrainer,
        GRPOConfig,
        GRPOTrainer,
        PPOConfig,
        PPOTrainer,
    )


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _MOVED_TO_TASKS:
        warnings.warn(
            f"trlx_scale.{name} moved to trlx_scale.tasks.{name} (the demo harness); the old name is removed in 0.3.",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(".tasks", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
