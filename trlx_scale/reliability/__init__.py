"""Surviving faults: non-finite steps, failing reward functions, torn checkpoints."""

from .checkpoints import CHECKPOINT_COMPLETE_MARKER, is_complete_checkpoint, latest_complete_checkpoint
from .nonfinite_guard import NonFiniteTrainingError
from .reward_guard import RewardFunctionError, guard_reward_functions

__all__ = [
    "CHECKPOINT_COMPLETE_MARKER",
    "NonFiniteTrainingError",
    "RewardFunctionError",
    "guard_reward_functions",
    "is_complete_checkpoint",
    "latest_complete_checkpoint",
]
