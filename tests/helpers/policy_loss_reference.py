"""The clipped policy-gradient surrogate as a pure function: the reference TRL's inline GRPO/PPO loss is tested
against, for every ratio level (tests/test_gspo.py), and the loss of the GPU benchmark of the asynchronous producer.
The trainers use TRL's loss (no hook calls this); shapes as in ``trlx_scale.losses.policy_losses``."""

from __future__ import annotations

import torch

from trlx_scale.losses.policy_losses import log_importance_weights


def _masked_sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


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
