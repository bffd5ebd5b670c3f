from .async_grpo_config import AsyncGRPOConfig
from .async_grpo_trainer import AsyncGRPOTrainer
from .dpo_config import DPOConfig
from .dpo_trainer import DPOTrainer
from .grpo_config import GRPOConfig
from .grpo_trainer import GRPOTrainer
from .ppo_config import PPOConfig
from .ppo_trainer import PPOTrainer

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "PPOConfig",
    "PPOTrainer",
]
