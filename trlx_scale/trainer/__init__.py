from .grpo_config import GRPOConfig
from .grpo_trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
