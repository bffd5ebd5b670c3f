"""vLLM's importance-sampling correction from the loss pass, for a batch whose old-policy pass was skipped.

TRL computes the loss pass's log-probs inside ``_compute_loss`` and forms the ratios inline. Two things happen in
between, at ``GRPOTrainer``'s seams (``grpo.trainer``):

- vLLM's importance-sampling correction from the loss pass (``old_logprobs_from_loss_pass``): where the loss pass
  runs with the weights that generated the batch, the rollout collector runs no separate old-policy pass and the
  correction is computed here from the loss pass's detached log-probs (``_defers_old_logprobs``,
  ``_deferred_correction``);
- GSPO-token's weights through TRL's token branch (``_postprocess_loss_logps``).

Both need the micro-batch, which TRL's ``_compute_loss`` does not hand to the pass it runs: it is bound for that one
call by ``compat.trl_loss_pass``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compat import trl_trainer_state as trl_state
from ..losses.vllm_importance_sampling import vllm_importance_sampling_ratio
from ..rollout.collector import log_importance_sampling


def deferred_correction(trainer: Any, logps: torch.Tensor, inputs: dict) -> None:
    """vLLM's importance-sampling correction of a batch whose old-policy pass was skipped, from the loss pass's
    log-probs (detached: they are the old ones), put where TRL's loss reads it; and TRL's sampling/* metrics.
    A no-op for a batch that already has its correction (TRL's pass ran)."""
    if "importance_sampling_ratio" in inputs or "sampling_per_token_logps" not in inputs:
        return
    if not trainer._defers_old_logprobs():
        return
    mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
    old, sampling = logps.detach(), inputs["sampling_per_token_logps"]
    mode = trainer.vllm_importance_sampling_mode
    ratio = vllm_importance_sampling_ratio(
        old,
        sampling,
        mask,
        mode,
        trainer.vllm_importance_sampling_clip_min,
        trainer.vllm_importance_sampling_clip_max,
        trainer._sequence_weight_normalisation(),
    )
    inputs["importance_sampling_ratio"] = ratio
    metrics = trl_state.metrics(trainer, "train" if trainer.model.training else "eval")
    log_importance_sampling(trainer, metrics, old, sampling, ratio, mask)
