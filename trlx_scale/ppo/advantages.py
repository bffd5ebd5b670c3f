"""Per-token rewards, generalized advantage estimation and whitening over completion tokens (masked, batched).

Shapes: ``(batch, completion_length)`` with a 0/1 ``mask`` of the tokens the policy acted on: right padding, and in
a multi-turn trajectory the tool results and environment observations between its turns (0 in the middle of the
row). Only those tokens carry rewards, values and advantages; the others come out as zeros, and an observation is
not a step of the episode: GAE runs over the acted tokens in order, as on the row with the observations removed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def per_token_kl(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """KL(pi || pi_ref) estimate per sampled token (Schulman's k1 / k3).

    k1 = log pi - log pi_ref (unbiased, can be negative per token); k3 = (r - 1) - log r with r = pi_ref / pi
    (unbiased, always >= 0, lower variance).
    """
    log_ratio = logps - ref_logps
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {estimator!r}.")


def kl_penalty_rewards(scores: torch.Tensor, kl: torch.Tensor, kl_coef: float, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards: -kl_coef * KL on every completion token, plus the sequence score on its last real token
    (Ziegler et al. 2019; the InstructGPT/TRL PPO recipe). A sequence with no real token gets nothing."""
    rewards = -kl_coef * kl * mask
    has_tokens = mask.sum(dim=1) > 0
    # The last position the mask holds (not the count of real tokens: observations may sit between turns).
    positions = torch.arange(mask.size(1), device=mask.device)
    last = (positions * (mask > 0)).amax(dim=1)
    rows = torch.arange(scores.size(0), device=scores.device)
    rewards[rows[has_tokens], last[has_tokens]] += scores[has_tokens].to(rewards.dtype)
    return rewards


def turn_ends(mask: torch.Tensor) -> list[list[int]]:
    """Per row, the last position of each run of masked-in tokens: in a multi-turn row, the last sampled token of
    each assistant turn (observations between turns are masked out)."""
    ends = []
    for row in mask.bool().tolist():
        ends.append([t for t, bit in enumerate(row) if bit and (t + 1 == len(row) or not row[t + 1])])
    return ends


def place_turn_rewards(
    turn_rewards: list[list[float | None] | None], mask: torch.Tensor, weight: float = 1.0
) -> torch.Tensor:
    """Per-token rewards with each step's reward on the last sampled token of the turn that earned it (step k: the
    k-th turn), times ``weight``; a step without a reward (None) adds nothing. A row with more step rewards than
    turns (a turn cut out of the mask) puts the rest on its last turn; a row without turns gets nothing."""
    placed = torch.zeros(mask.shape, dtype=torch.float64)
    for row, (rewards, ends) in enumerate(zip(turn_rewards, turn_ends(mask), strict=True)):
        for step, reward in enumerate(rewards or []):
            if reward is not None and ends:
                placed[row, ends[min(step, len(ends) - 1)]] += weight * float(reward)
    return placed.to(mask.device)


def turn_discounts(mask: torch.Tensor, discount: float) -> torch.Tensor:
    """Per-token factors for ``gae``'s ``discounts``: ``discount`` on the last sampled token of every turn but a
    row's last (where the next turn's value and advantage are brought back), 1 elsewhere."""
    factors = torch.ones(mask.shape, dtype=torch.float64)
    for row, ends in enumerate(turn_ends(mask)):
        for end in ends[:-1]:
            factors[row, end] = discount
    return factors.to(mask.device)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    discounts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over each row's real tokens; returns ``(advantages, returns)``.

    delta_t = r_t + gamma * V_{t+1} - V_t with V = 0 after the last real token (the episode ends there);
    A_t = delta_t + gamma * lam * A_{t+1}; returns R_t = A_t + V_t. "t+1" is the next masked-in token: positions
    outside the mask (observations between turns, padding) are skipped, so a turn's advantage carries the later
    turns' rewards and values through the tool result that separates them. ``discounts`` (same shape, optional):
    a further factor on gamma at each position (``turn_discounts``: a discount per turn, besides the one per token).
    """
    rewards, values, mask = rewards * mask, values * mask, mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_advantage = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.size(1))):
        real = mask[:, t]
        step_gamma = gamma if discounts is None else gamma * discounts[:, t].to(values.dtype)
        delta = rewards[:, t] + step_gamma * next_value - values[:, t]
        advantage = delta + step_gamma * lam * next_advantage
        advantages[:, t] = advantage * real
        # A position outside the mask passes the later token's advantage and value through unchanged (after the last
        # real token they are still the zeros the episode ends with).
        next_advantage = torch.where(real > 0, advantage, next_advantage)
        next_value = torch.where(real > 0, values[:, t], next_value)
    return advantages, (advantages + values) * mask


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    sum_across_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Normalize to zero mean and unit variance over the masked entries (unbiased variance); padding stays zero.

    ``sum_across_ranks`` (an all-reduce SUM): the statistics are those of every rank's entries together, so that
    2 processes x B/2 rows whiten as 1 process x B rows does."""
    total = sum_across_ranks or (lambda tensor: tensor)
    mask = mask.to(values.dtype)
    count = total(mask.sum())
    mean = total((values * mask).sum()) / count
    variance = total((((values - mean) * mask) ** 2).sum()) / (count - 1).clamp(min=1)
    whitened = (values - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask
