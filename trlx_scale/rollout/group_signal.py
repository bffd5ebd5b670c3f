"""Which GRPO groups carry a learning signal: a group whose rewards are all equal has advantage 0 (DAPO).

The reward compared is the one TRL's advantages are computed from: each function's reward times its weight, summed
over the functions that scored the completion (NaN where none did), as TRL's ``frac_reward_zero_std`` reads it. A
group is informative when the std of that reward over its completions is above ``min_std`` and not (close to) zero;
a group whose completions no function scored has none. Both trainers' dynamic sampling decide with this function:
``GRPOTrainer`` for a whole round at once, ``AsyncGRPOTrainer``'s producer for one group as it is scored.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import nanstd


def informative_groups(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, group_size: int, min_std: float
) -> torch.Tensor:
    """(B / group_size,) bool: whether each group of ``group_size`` consecutive rows of ``rewards_per_func`` (B, F),
    NaN where a function returned None, has a weighted-reward std above ``min_std``."""
    weights = reward_weights.to(device=rewards_per_func.device, dtype=rewards_per_func.dtype)
    weighted = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    weighted[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    spread = nanstd(weighted.view(-1, group_size), dim=1)
    flat = torch.isclose(spread, torch.zeros_like(spread)) | (spread <= min_std) | torch.isnan(spread)
    return ~flat
