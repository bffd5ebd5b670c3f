"""Importance ratios as pure tensor functions (no trainer state).

``log_importance_weights`` is called by the trainers (GSPO-token). The clipped surrogate that TRL computes inline for
GRPO and PPO is restated in ``tests/helpers/policy_loss_reference.py``, the reference TRL's loss is tested against.

Shapes: ``logps``, ``old_logps``, ``mask``: (B, T) per-token log-probs of the sampled completion tokens under the
current and the behaviour policy, and 1 for real tokens / 0 for padding; ``advantages``: (B,).

Importance ratios:
- token (GRPO/PPO): r_it = exp(log pi(y_it) - log pi_old(y_it)), one per token;
- sequence (GSPO): s_i = exp(mean_t(log pi - log pi_old)) over the sequence's real tokens, one per sequence;
- sequence_token (GSPO-token): sg[s_i] * pi(y_it) / sg[pi(y_it)] per token: the value of s_i on every token, but a
  per-token gradient, so token-level advantages could be used.
"""

from __future__ import annotations

import torch

LEVELS = ("token", "sequence", "sequence_token")


def _masked_sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def log_importance_weights(
    logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """Log importance weights: (B, T) for "token" and "sequence_token", (B, 1) for "sequence"."""
    log_ratio = logps - old_logps
    if level == "token":
        return log_ratio
    sequence = _masked_sequence_mean(log_ratio, mask).unsqueeze(-1)
    if level == "sequence":
        return sequence
    if level == "sequence_token":
        return sequence.detach() + logps - logps.detach()
    raise ValueError(f"importance_sampling_level must be one of {LEVELS}, got {level!r}.")
