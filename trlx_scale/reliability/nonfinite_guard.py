"""Skip an optimizer step whose loss or gradient norm is not finite, and stop after too many in a row.

Why: one NaN gradient reaches the fp32 masters through Adam, then the bf16 weights, then vLLM, and training goes on
sampling from a broken policy while the loss curve only shows ``nan``. The guard decides before the optimizer step,
with the gradient norm the trainer has just computed (global: the same on every rank after DDP/FSDP reduced the
gradients) and the micro-batch losses of the accumulation window (reduced across ranks with one MAX all-reduce), so
every rank takes the same decision.

A skipped step drops the gradients (``optimizer.zero_grad(set_to_none=True)``), so AdamW and ``FP32MasterAdamW``
leave every parameter, master and moment untouched (a parameter without a gradient is not stepped); the learning
rate schedule still advances, and the policy version stays, so vLLM is not re-synced (the weights did not change). After
``max_consecutive_skipped_steps`` skipped steps in a row training stops with ``NonFiniteTrainingError``.

DeepSpeed applies its optimizer step inside ``backward``, before any hook of the trainer runs: there the guard
cannot skip; it counts the non-finite steps and stops after the same limit (a warning says so at start).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.utils import logging

from ..trainer_part import TrainerPart

logger = logging.get_logger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """Raised after ``max_consecutive_skipped_steps`` optimizer steps in a row had a non-finite loss or gradient."""


class NonFiniteGuard(TrainerPart):
    """The trainer's guard (``trlx_scale.trainer_features`` builds it after TRL's ``__init__``): ``note_loss`` after
    each training step, ``decide`` on the gradient norm right before the optimizer step, ``log_metrics`` in every
    log. Reads ``max_consecutive_skipped_steps`` (None: its default; 0: the guard is off). The trainer's seams
    ``_on_skipped_step`` (PPO drops its critic's gradients there) and ``_extra_gradients_finite`` (PPO's critic) are
    called back."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        self.limit = int(trainer.args.max_consecutive_skipped_steps)
        self.window_loss_finite: torch.Tensor | bool = True  # every micro-batch loss of the window was finite
        self.skip = False  # the decision for the optimizer step about to run
        self.skipped_total = 0
        self.consecutive = 0
        if self.limit > 0:
            trainer.add_callback(_DropGradientsOfSkippedStep(trainer))
            if getattr(trainer, "is_deepspeed_enabled", False):
                logger.warning(
                    "Non-finite guard under DeepSpeed: DeepSpeed steps its optimizer inside backward, so a "
                    "non-finite step cannot be skipped; it is counted (reliability/skipped_steps) and training "
                    "stops after max_consecutive_skipped_steps of them."
                )

    def note_loss(self, loss: torch.Tensor) -> None:
        """After each micro-batch's training step: whether its loss was finite."""
        if self.limit > 0:
            # Kept as a tensor until the step's decision: no device sync per micro-batch.
            self.window_loss_finite = torch.isfinite(loss.detach()).all() & self.window_loss_finite

    def decide(self, grad_norm) -> None:
        """Right before the optimizer step, with the norm transformers just computed: skip it or not (every rank
        takes the same decision: one MAX all-reduce)."""
        if self.limit <= 0:
            return
        trainer = self.trainer
        accelerator = trainer.accelerator
        norm = float(grad_norm) if grad_norm is not None else 0.0
        local_bad = ~torch.as_tensor(self.window_loss_finite, device=accelerator.device)
        local_bad = local_bad | ~torch.as_tensor(trainer._extra_gradients_finite(), device=accelerator.device)
        bad = local_bad.to(torch.float32).reshape(1)
        if accelerator.num_processes > 1:
            bad = accelerator.reduce(bad, reduction="max")
        self.window_loss_finite = True
        self.skip = bool(bad.item()) or not math.isfinite(norm)
        if not self.skip:
            self.consecutive = 0
            return
        self.skipped_total += 1
        self.consecutive += 1
        step = trainer.state.global_step + 1
        logger.warning(
            "Step %d: non-finite %s; the optimizer step is skipped (%d in a row, %d in all).",
            step,
            "gradient norm" if not math.isfinite(norm) else "loss",
            self.consecutive,
            self.skipped_total,
        )
        if self.consecutive >= self.limit:
            raise NonFiniteTrainingError(
                f"{self.consecutive} optimizer steps in a row (up to step {step}) had a non-finite loss or "
                f"gradient norm (last gradient norm: {norm}). The weights were kept from before the first of them. "
                "Lower learning_rate or max_grad_norm, check the reward functions and the data, or raise "
                "max_consecutive_skipped_steps (0 turns the guard off)."
            )

    def log_metrics(self, logs: dict[str, float]) -> dict[str, float]:
        if self.limit > 0 and "loss" in logs:  # training logs (evaluation logs have eval_loss)
            return {"reliability/skipped_steps": float(self.skipped_total)}
        return {}


class _DropGradientsOfSkippedStep(TrainerPart, TrainerCallback):
    """Right before the optimizer step: drop the gradients of a step the guard skips (AdamW then changes nothing)."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer is not None and trainer.nonfinite_guard.skip:
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer._on_skipped_step()

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer is not None and trainer.nonfinite_guard.skip:
            # The weights did not change: the policy version stays (rollout.policy_version), so does the engine.
            trainer.nonfinite_guard.skip = False
