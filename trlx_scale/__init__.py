"""trlx_scale: TRL's trainers with the systems techniques of verl and OpenRLHF.

``from trlx_scale import GRPOTrainer, GRPOConfig`` is a drop-in replacement for ``from trl import ...``.
"""

from .data.addition import addition_dataset, exact_match_reward
from .models.default_model import default_model_path
from .trainer import GRPOConfig, GRPOTrainer

__version__ = "0.1.0"

__all__ = [
    "GRPOConfig",
    "GRPOTrainer",
    "__version__",
    "addition_dataset",
    "default_model_path",
    "exact_match_reward",
]
