"""pass@k of a binary reward over GRPO groups: the chance that at least one of k completions drawn without
replacement from a group of n is correct, estimated without bias from the group's c correct completions
(Chen et al., 2021, "Evaluating Large Language Models Trained on Code"):

    pass@k = 1 - C(n - c, k) / C(n, k)

Evaluation logs pass@1 (the mean reward of a binary reward) and pass@n (some completion of the group is correct)."""

from __future__ import annotations

import math

import torch


def is_binary(rewards: torch.Tensor) -> bool:
    """Whether every scored reward (NaN: not scored) is 0 or 1."""
    scored = rewards[~torch.isnan(rewards)]
    return scored.numel() > 0 and bool(((scored == 0) | (scored == 1)).all())


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The unbiased estimate for one group of ``num_samples`` completions, ``num_correct`` of them correct."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= the group's size ({num_samples}), got k={k}.")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def group_pass_at_k(rewards: torch.Tensor, group_size: int, ks: tuple[int, ...]) -> dict[int, float]:
    """{k: the mean of pass@k over the groups} of ``rewards`` (binary, each group's ``group_size`` completions
    together; a group with a NaN reward counts its scored completions only)."""
    if rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of {group_size}.")
    per_k: dict[int, list[float]] = {k: [] for k in ks}
    for group in rewards.view(-1, group_size):
        scored = group[~torch.isnan(group)]
        for k in ks:
            if k <= scored.numel():
                per_k[k].append(pass_at_k(scored.numel(), int(scored.sum().item()), k))
    return {k: sum(values) / len(values) for k, values in per_k.items() if values}
