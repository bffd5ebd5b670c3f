"""trlx_scale: TRL's trainers with the systems techniques of verl and OpenRLHF.

``from trlx_scale import GRPOTrainer, GRPOConfig`` (and ``DPOTrainer``, ``DPOConfig``; ``PPOTrainer``, ``PPOConfig`` replace TRL's removed PPO) is a drop-in replacement for
``from trl import ...``; ``AsyncGRPOTrainer``, ``AsyncGRPOConfig`` for TRL's experimental asynchronous GRPO.

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
    "AsyncGRPOConfig": ".async_grpo.config",
    "AsyncGRPOTrainer": ".async_grpo.trainer",
    "DPOConfig": ".dpo.config",
    "DPOTrainer": ".dpo.trainer",
    "GRPOConfig": ".grpo.config",
    "GRPOTrainer": ".grpo.trainer",
    "PPOConfig": ".ppo.config",
    "PPOTrainer": ".ppo.trainer",
}

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
    from .async_grpo.config import AsyncGRPOConfig
    from .async_grpo.trainer import AsyncGRPOTrainer
    from .dpo.config import DPOConfig
    from .dpo.trainer import DPOTrainer
    from .grpo.config import GRPOConfig
    from .grpo.trainer import GRPOTrainer
    from .ppo.config import PPOConfig
    from .ppo.trainer import PPOTrainer


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
