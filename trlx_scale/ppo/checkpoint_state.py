"""``PPOTrainer``'s checkpoint state beside the policy's: the critic (its weights and optimizer, or the shared-base
adapter and head) and the KL controller's coefficient, in ``PPO_STATE_NAME``; a checkpoint without it cannot resume
a PPO run.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..trainer_part import TrainerPart
from .critic import critic_state, load_critic_state

PPO_STATE_NAME = "ppo_state.pt"


class PPOStatePart(TrainerPart):
    """``PPOTrainer``'s checkpoint part (``reliability.checkpoint_parts``): the critic and the KL coefficient."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)

    def save(self, checkpoint_dir: str) -> None:
        trainer = self.trainer
        # Every rank takes part (ZeRO-3 gathers; a DeepSpeed critic writes its own partitions); rank 0 writes the file.
        if trainer.critic_training is not None:
            state = trainer.critic_training.save(checkpoint_dir, trainer.args.should_save)
        else:  # the shared-base critic's optimizer state is in the policy's optimizer, saved by transformers
            state = {"critic": critic_state(trainer.critic)}
        if trainer.args.should_save:
            state["kl_coef"] = trainer.kl_controller.value
            torch.save(state, os.path.join(checkpoint_dir, PPO_STATE_NAME))

    def load(self, checkpoint_dir: str) -> None:
        trainer = self.trainer
        path = os.path.join(checkpoint_dir, PPO_STATE_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"{checkpoint_dir} has no {PPO_STATE_NAME} (the critic, its optimizer and the KL coefficient): it was "
                "not written by trlx_scale's PPOTrainer, whose runs cannot resume without their critic."
            )
        state = torch.load(path, map_location="cpu", weights_only=True)
        if trainer.critic_training is not None:
            trainer.critic_training.load(checkpoint_dir, state)
        else:
            load_critic_state(trainer.critic, state["critic"])
        trainer.kl_controller.value = float(state["kl_coef"])
