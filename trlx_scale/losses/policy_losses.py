"""Importance ratios and the clipped policy-gradient surrogate as pure tensor functions (no trainer state).

``log_importance_weights`` is called by the trainers (GSPO-token). ``clipped_policy_loss`` is the reference
implementation of the loss TRL computes inline for GRPO and PPO: tests compare TRL's loss with it (see
``trlx_scale.losses``).

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


def clipped_policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    level: str = "token",
    aggregation: str = "sequence_mean",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-style clipped surrogate, -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), aggregated over real tokens.

    The reference TRL's inline loss is tested against (the trainers use TRL's, which has no hook to call this).

    ``aggregation``: "sequence_mean" averages each sequence over its tokens, then over sequences (every sequence
    weighs the same: GSPO's choice); "token_mean" averages over all real tokens of the batch (longer sequences weigh
    more). ``weights`` ((B, T) or (B, 1), no gradient) multiply each token's surrogate without changing the
    normaliser: the off-policy correction of the decoupled objective (docs/async.md). Returns the loss and clip statistics (fractions
    of real tokens clipped below / above).
    """
    if aggregation not in ("sequence_mean", "token_mean"):
        raise ValueError(f"aggregation must be 'sequence_mean' or 'token_mean', got {aggregation!r}.")
    mask = mask.to(logps.dtype)
    ratio = torch.exp(log_importance_weights(logps, old_logps, mask, level))
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    advantages = advantages.unsqueeze(-1)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    per_token = per_token.expand_as(mask)  # sequence level: one value per sequence, spread over its tokens
    if weights is not None:
        per_token = per_token * weights
    if aggregation == "sequence_mean":
        loss = _masked_sequence_mean(per_token, mask).mean()
    else:
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    low = ((ratio < 1 - epsilon_low) & (advantages < 0)).to(mask.dtype).expand_as(mask)
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).to(mask.dtype).expand_as(mask)
    tokens = mask.sum().clamp(min=1.0)
    return loss, {"clip_ratio/low": (low * mask).sum() / tokens, "clip_ratio/high": (high * mask).sum() / tokens}
