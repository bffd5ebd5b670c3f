"""GRPO's advantages from the rewards of every process's rows: each completion against its group's.

The same arithmetic as TRL 1.16's ``GRPOTrainer`` (``multi_objective_aggregation``, ``scale_rewards``, unscorable
rows), so that ``GRPOTrainer``'s rollouts, now collected by trlx_scale (``rollout.collector``), train exactly what
TRL's trained (``tests/test_grpo_trainer.py`` compares the two trainers bit for bit, and
``tests/test_group_advantages.py`` checks this function against TRL's code path on hand-made rewards).

Rows are every process's, in the order TRL gathers them (a group of ``num_generations`` consecutive rows may span
processes), so the caller slices out its own rows afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl.trainer.utils import nanstd

AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
SCALINGS = ("group", "batch", "none")


@dataclass
class GroupAdvantages:
    """``advantages``: (B_all,), 0 for a row no reward function scored; ``rewards``: (B_all,) the weighted reward of
    each row (NaN where unscorable), as logged; ``is_std_zero``: (B_all,) whether the row's normalising std is 0
    (logged as ``frac_reward_zero_std``)."""

    advantages: torch.Tensor
    rewards: torch.Tensor
    is_std_zero: torch.Tensor


def group_advantages(
    rewards_per_func: torch.Tensor,
    reward_weights: torch.Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> GroupAdvantages:
    """The advantages of (B_all, F) rewards (NaN: a function that returned None), with weights (F,).

    ``aggregation="sum_then_normalize"``: the weighted sum per row, minus its group's mean, divided by its group's
    std (``scale_rewards="group"``), the batch's std (``"batch"``) or nothing (``"none"``).
    ``"normalize_then_sum"``: each function normalised within its group, then the weighted sum normalised over the
    batch. A row every function left unscored has advantage 0 and no part in its group's baseline."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation must be one of {AGGREGATIONS}, got {aggregation!r}.")
    if scale_rewards not in SCALINGS:
        raise ValueError(f"scale_rewards must be one of {SCALINGS}, got {scale_rewards!r}.")
    weights = reward_weights.to(rewards_per_func.device).unsqueeze(0)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        group_mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
        if scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        elif num_generations > 1:  # "group", and "none" (its std only says which groups have no signal)
            std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
        else:  # one generation per prompt (evaluation with num_generations_eval=1)
            std = torch.zeros_like(rewards)
        advantages = rewards - group_mean
        if scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
    else:
        functions = rewards_per_func.size(1)
        grouped = rewards_per_func.view(-1, num_generations, functions)
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
        per_function = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, functions)
        rewards = (per_function * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    # The logged reward is the weighted sum of the raw rewards, whatever the aggregation.
    logged = (rewards_per_func * weights).nansum(dim=1)
    logged[unscorable] = torch.nan
    return GroupAdvantages(torch.nan_to_num(advantages, nan=0.0), logged, is_std_zero)
