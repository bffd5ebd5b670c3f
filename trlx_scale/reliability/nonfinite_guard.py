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
import weakref

import torch
from transformers import TrainerCallback
from transformers.utils import logging

from ..options import option

logger = logging.get_logger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """Raised after ``max_consecutive_skipped_steps`` optimizer steps in a row had a non-finite loss or gradient."""


class NonFiniteGuardMixin:
    """A trainer feature (``trlx_scale.trainer_features``: GRPO, PPO, DPO); ``_setup_nonfinite_guard`` runs in its
    post-init step, ``_guard_note_loss`` after each training step, ``_guard_log_metrics`` in every log. Reads ``max_consecutive_skipped_steps``
    (None: its default; 0: the guard is off)."""

    def _guard_limit(self) -> int:
        limit = option(self.args, "max_consecutive_skipped_steps")
        return option(None, "max_consecutive_skipped_steps") if limit is None else int(limit)

    def _setup_nonfinite_guard(self) -> None:
        self._nonfinite_guard = {
            "window_loss_finite": True,  # every micro-batch loss of the current accumulation window was finite
            "skip": False,  # the decision for the optimizer step about to run
            "skipped_total": 0,
            "consecutive": 0,
        }
        if self._guard_limit() > 0:
            self.add_callback(_DropGradientsOfSkippedStep(self))
            if getattr(self, "is_deepspeed_enabled", False):
                logger.warning(
                    "Non-finite guard under DeepSpeed: DeepSpeed steps its optimizer inside backward, so a "
                    "non-finite step cannot be skipped; it is counted (reliability/skipped_steps) and training "
                    "stops after max_consecutive_skipped_steps of them."
                )

    def _guard_state(self) -> dict:
        if not hasattr(self, "_nonfinite_guard"):
            raise RuntimeError("_setup_nonfinite_guard() did not run: the trainer lacks TrainerFeatures' post-init.")
        return self._nonfinite_guard

    def _on_skipped_step(self) -> None:
        """Seam, right before the skipped optimizer step (PPO drops its critic's gradients here)."""

    def _guard_note_loss(self, loss: torch.Tensor) -> None:
        """After each micro-batch's training step: whether its loss was finite."""
        if self._guard_limit() > 0:
            state = self._guard_state()
            # Kept as a tensor until the step's decision: no device sync per micro-batch.
            finite = torch.isfinite(loss.detach()).all()
            state["window_loss_finite"] = finite & state["window_loss_finite"]

    def _extra_gradients_finite(self) -> torch.Tensor | bool:
        """Seam: gradients stepped outside the trainer's optimizer (PPO's critic) that must be finite as well."""
        return True

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if self._guard_limit() > 0:
            self._decide_step(grad_norm)
        return grad_norm

    def _decide_step(self, grad_norm) -> None:
        state = self._guard_state()
        norm = float(grad_norm) if grad_norm is not None else 0.0
        local_bad = ~torch.as_tensor(state["window_loss_finite"], device=self.accelerator.device)
        local_bad = local_bad | ~torch.as_tensor(self._extra_gradients_finite(), device=self.accelerator.device)
        bad = local_bad.to(torch.float32).reshape(1)
        if self.accelerator.num_processes > 1:
            bad = self.accelerator.reduce(bad, reduction="max")
        state["window_loss_finite"] = True
        state["skip"] = bool(bad.item()) or not math.isfinite(norm)
        if not state["skip"]:
            state["consecutive"] = 0
            return
        state["skipped_total"] += 1
        state["consecutive"] += 1
        step = self.state.global_step + 1
        logger.warning(
            "Step %d: non-finite %s; the optimizer step is skipped (%d in a row, %d in all).",
            step,
            "gradient norm" if not math.isfinite(norm) else "loss",
            state["consecutive"],
            state["skipped_total"],
        )
        if state["consecutive"] >= self._guard_limit():
            raise NonFiniteTrainingError(
                f"{state['consecutive']} optimizer steps in a row (up to step {step}) had a non-finite loss or "
                f"gradient norm (last gradient norm: {norm}). The weights were kept from before the first of them. "
                "Lower learning_rate or max_grad_norm, check the reward functions and the data, or raise "
                "max_consecutive_skipped_steps (0 turns the guard off)."
            )

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped by the guard so far in this run."""
        return self._guard_state()["skipped_total"]

    def _guard_log_metrics(self, logs: dict[str, float]) -> dict[str, float]:
        if self._guard_limit() > 0 and "loss" in logs:  # training logs (evaluation logs have eval_loss)
            return {"reliability/skipped_steps": float(self._guard_state()["skipped_total"])}
        return {}


class _DropGradientsOfSkippedStep(TrainerCallback):
    """Right before the optimizer step: drop the gradients of a step the guard skips (AdamW then changes nothing)."""

    def __init__(self, trainer: NonFiniteGuardMixin):
        self._trainer = weakref.ref(trainer)  # no trainer <-> callback cycle (see profiling's _StepClock)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None and trainer._guard_state()["skip"]:
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer._on_skipped_step()

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None and trainer._guard_state()["skip"]:
            # The weights did not change: the policy version stays (rollout.policy_version), so does the engine.
            trainer._guard_state()["skip"] = False
