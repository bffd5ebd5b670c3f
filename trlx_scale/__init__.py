"""trlx_scale: TRL's trainers with the systems techniques of verl and OpenRLHF.

``from trlx_scale import GRPOTrainer, GRPOConfig`` (and ``DPOTrainer``, ``DPOConfig``; ``PPOTrainer``, ``PPOConfig`` replace TRL's removed PPO) is a drop-in replacement for
``from trl import ...``.
"""

from .data.addition import addition_dataset, addition_preference_dataset, exact_match_reward
from .models.default_model import default_model_path
from .trainer import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer

__version__ = "0.1.0"

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
