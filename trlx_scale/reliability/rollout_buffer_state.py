"""``RolloutBufferPart``: a checkpoint taken inside a rollout's mini-batches resumes inside it.

TRL restarts its micro-step counter at 0 and drops the rollout buffer on resume: a checkpoint taken in the middle of
a rollout's mini-batches (``steps_per_generation`` or ``num_iterations`` > 1) would then regenerate early and shift
every later rollout. Each rank saves both (its buffer is its own) and loads them back at the same world size.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate.utils import send_to_device
from transformers.utils import logging

from ..compat import trl_trainer_state as trl_state
from ..trainer_part import TrainerPart
from .checkpoints import checkpoint_world_size

logger = logging.get_logger(__name__)

ROLLOUT_STATE_NAME = "rollout_state_rank{}.pt"


class RolloutBufferPart(TrainerPart):
    """``GRPOTrainer``'s checkpoint part (``reliability.checkpoint_parts``; see the module docstring)."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)

    def save(self, checkpoint_dir: str) -> None:
        """TRL restarts its micro-step counter at 0 and drops the rollout buffer on resume: a checkpoint taken in the
        middle of a rollout's mini-batches (steps_per_generation or num_iterations > 1) would then regenerate early
        and shift every later rollout. Each rank saves both (its buffer is its own)."""
        trainer = self.trainer
        step, buffered_inputs = trl_state.generation_buffer(trainer)
        state = {"step": step, "buffered_inputs": send_to_device(buffered_inputs, "cpu")}
        torch.save(state, os.path.join(checkpoint_dir, ROLLOUT_STATE_NAME.format(trainer.accelerator.process_index)))

    def load(self, checkpoint_dir: str) -> None:
        trainer = self.trainer
        saved = checkpoint_world_size(checkpoint_dir)
        if saved is not None and saved != trainer.accelerator.num_processes:
            # Each rank's buffer holds its share of the rollout: at another world size the shares do not map.
            logger.warning(
                "%s was saved by %d processes, this run has %d: the rollout in progress is generated afresh.",
                checkpoint_dir,
                saved,
                trainer.accelerator.num_processes,
            )
            return
        path = os.path.join(checkpoint_dir, ROLLOUT_STATE_NAME.format(trainer.accelerator.process_index))
        if not os.path.isfile(path):
            logger.warning("%s is missing: the first rollout after resuming is generated afresh.", path)
            return
        state = torch.load(path, map_location="cpu", weights_only=False)  # our own file: tensors and lists
        trl_state.set_generation_buffer(
            trainer, int(state["step"]), send_to_device(state["buffered_inputs"], trainer.accelerator.device)
        )
