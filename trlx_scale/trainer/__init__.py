from .dpo_config import DPOConfig
from .dpo_trainer import DPOTrainer
from .grpo_config import GRPOConfig
from .grpo_trainer import GRPOTrainer
from .ppo_config import PPOConfig
from .ppo_trainer import PPOTrainer

__all__ = ["DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "PPOConfig", "PPOTrainer"]
