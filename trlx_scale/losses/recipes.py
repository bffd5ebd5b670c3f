"""Loss recipes: named sets of GRPOConfig values from papers, applied like the optimizer presets (fields the user
left at their default take the recipe's value).

gspo (Qwen, "Group Sequence Policy Optimization", 2025): sequence-level importance ratios
s_i = exp(mean_t(log pi - log pi_old)), clipped to [1 - 3e-4, 1 + 4e-4] (sequence ratios concentrate near 1, so the
range is ~1000x narrower than PPO's 0.2), the loss averaged per sequence ("grpo" aggregation: every sequence weighs
the same), and no KL penalty. It also turns the shared-prefix pass to "auto" (GSPO's groups share their prompt).
"""

from __future__ import annotations

from typing import Any

from ..config_defaults import fill_unset_fields

RECIPES: dict[str, dict[str, Any]] = {
    "gspo": {
        "importance_sampling_level": "sequence",
        "epsilon": 3e-4,
        "epsilon_high": 4e-4,
        "loss_type": "grpo",
        "beta": 0.0,
        "shared_prefix": "auto",
    },
}

# Losses that sum token terms over the batch: with one ratio per sequence they weight each sequence by its length.
LENGTH_WEIGHTED_LOSSES = ("bnpo", "dr_grpo", "dapo", "cispo")


def apply_recipe(config: Any, name: str) -> dict[str, tuple[Any, str]]:
    """Fill ``config``'s fields still at their class default with the recipe; ``{field: (value, "recipe"|"user")}``."""
    if name not in RECIPES:
        raise ValueError(f"loss_recipe must be one of {sorted(RECIPES)}, got {name!r}.")
    return fill_unset_fields(config, RECIPES[name], source="recipe")
