"""The PPO critic's clipped value loss (as in OpenAI baselines / TRL's former PPOTrainer)."""

from __future__ import annotations

import torch


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 * masked mean of max((V - R)^2, (clip(V, V_old +- c) - R)^2); returns ``(loss, clip_fraction)``.

    Clipping keeps the new value within ``cliprange_value`` of the value at rollout time, so one batch cannot move
    the critic far; taking the max makes the loss pessimistic (the clipped error only counts when it is larger).
    """
    mask = mask.to(values.dtype)
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped - returns) ** 2
    count = mask.sum().clamp(min=1)
    loss = 0.5 * (torch.maximum(unclipped_error, clipped_error) * mask).sum() / count
    clip_fraction = ((clipped_error > unclipped_error).to(values.dtype) * mask).sum() / count
    return loss, clip_fraction
