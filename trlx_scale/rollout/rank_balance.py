"""Moving rollout samples between ranks before the loss pass, so that every rank's share costs about the same.

TRL keeps each sample on the rank that generated it. Completion lengths are long-tailed, so one rank can hold the
long ones: under DDP the others wait for it at every gradient all-reduce, under ZeRO-3/FSDP2 at every forward. Here,
once the rollout is scored (advantages computed from every rank's rewards), the samples are re-dealt:

1. every rank's per-sample lengths are gathered (one all-gather of B numbers per rank);
2. ``balanced_rank_assignment`` deals units (a GRPO group where every rank holds whole groups, as TRL's layout then
   does: the shared prefix forwards its prompt once on one rank; else a sample) longest-first to the rank with the least cost so far that still has room, by the packed-row cost
   ``c * L + L**2`` (``passes.micro_batch_plan.sample_cost``); every rank keeps exactly its count of samples, so
   TRL's split into micro-batches, its shuffle and every per-micro-batch count are unchanged;
3. if that lowers the costliest rank's cost by more than 1 percent (``RankBalance``; else nothing moves),
   ``exchange_rows`` moves the rows: each per-row tensor is padded to the widest rank's width, all-gathered, and a
   rank keeps its rows, trimmed back to the columns they use.

What keeps the loss exact: where an optimizer step spans whole generation batches (``gradient_accumulation_steps`` a
multiple of ``steps_per_generation``, TRL's default), its gradient is a sum over them whose per-sample weights depend
only on counts that moving a sample between ranks does not change, for every TRL ``loss_type`` but one:
``grpo``/``sapo``/``luspo`` (a mean over the micro-batch's sequences, whose count stays), ``dr_grpo`` (a constant),
``dapo``/``cispo``/``vespo`` (the generation batch's token count). What depends on which samples share a
micro-batch or a forward refuses the move (``rank_balance_blocker``): ``bnpo`` (the micro-batch's token count),
``top_entropy_quantile < 1`` (a per-micro-batch threshold), the entropy bonus (a per-micro-batch token mean), a
router's load-balancing loss (per forward), and optimizer steps that take part of a generation batch; so do rollouts
with image inputs (``unmovable_rollout_reason``). Padded columns get TRL's values where they are read unmasked (the
importance-sampling ratio: 1).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..passes.micro_batch_plan import sample_cost

# Loss types whose normaliser depends on which samples share a micro-batch (see the module docstring).
COMPOSITION_DEPENDENT_LOSS_TYPES = ("bnpo",)
# Per-row tensors aligned with the prompt's columns (left-padded); every other 2D per-row tensor is aligned with the
# completion's (right-padded) or has one column (a sequence-level importance ratio).
PROMPT_ALIGNED = ("prompt_ids", "prompt_mask")
# Padding values other than 0: TRL's importance-sampling ratio is exp(0) = 1 at padded columns, and VESPO's gamma
# weights sum its logarithm without a mask.
PAD_VALUES = {"importance_sampling_ratio": 1.0}
# TRL rollout keys that are not per-row and hold the same value on every rank (the generation batch's token count).
GLOBAL_KEYS = ("num_items_in_batch",)
# TRL rollout keys that cannot be moved row by row (image inputs are not one row per sample).
UNMOVABLE_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
    "num_images",
    "num_tiles",
)


def rank_balance_blocker(
    loss_type: str,
    top_entropy_quantile: float,
    entropy_bonus: bool = False,
    router_aux_loss: bool = False,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
) -> str | None:
    """Why this run's rollouts cannot move between ranks without changing its gradient, or None (the run's
    settings; ``unmovable_rollout_reason`` checks each rollout)."""
    if loss_type in COMPOSITION_DEPENDENT_LOSS_TYPES:
        return f"loss_type={loss_type!r} divides by each micro-batch's token count, which a move changes"
    if top_entropy_quantile < 1.0:
        return "top_entropy_quantile < 1 thresholds entropies per micro-batch, which a move changes"
    if entropy_bonus:
        return "the entropy bonus (entropy_coef, use_adaptive_entropy) is a mean over each micro-batch's tokens"
    if router_aux_loss:
        return "the router's load-balancing loss is computed per forward, over the samples that share it"
    if gradient_accumulation_steps % steps_per_generation:
        return (
            "an optimizer step takes part of a rank's generation batch (gradient_accumulation_steps is not a "
            "multiple of steps_per_generation), so which samples it takes would change"
        )
    return None


def unmovable_rollout_reason(keys: Iterable[str]) -> str | None:
    """Why this rollout's rows cannot move (image inputs are not one row per sample), or None."""
    unmovable = sorted(set(keys) & set(UNMOVABLE_KEYS))
    if unmovable:
        return f"the rollout holds image inputs ({', '.join(unmovable)}), which are not one row per sample"
    return None


def balanced_rank_assignment(
    lengths: list[int], num_ranks: int, coefficient: float, unit_size: int = 1
) -> list[list[int]]:
    """Each rank's sample indices (into ``lengths``, every rank's samples in rank order), each rank exactly
    ``len(lengths) // num_ranks`` of them, in increasing order.

    Units of ``unit_size`` consecutive samples (a GRPO group) move together; longest-first (by summed
    ``sample_cost``) to the rank with the least cost that has room (LPT with a capacity), ties to the fewer samples
    then the lower rank: deterministic, so every rank computes the same assignment from the same lengths."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}.")
    total = len(lengths)
    if total % num_ranks:
        raise ValueError(f"{total} samples cannot be dealt evenly to {num_ranks} ranks.")
    capacity = total // num_ranks
    if unit_size < 1 or capacity % unit_size:
        raise ValueError(f"units of {unit_size} samples do not fill a rank's {capacity} samples evenly.")
    units = [list(range(start, start + unit_size)) for start in range(0, total, unit_size)]
    costs = [sum(sample_cost(lengths[i], coefficient) for i in unit) for unit in units]
    order = sorted(range(len(units)), key=lambda u: (-costs[u], u))
    assigned: list[list[int]] = [[] for _ in range(num_ranks)]
    rank_costs = [0.0] * num_ranks
    for u in order:
        open_ranks = [r for r in range(num_ranks) if len(assigned[r]) + unit_size <= capacity]
        rank = min(open_ranks, key=lambda r: (rank_costs[r], len(assigned[r]), r))
        assigned[rank].extend(units[u])
        rank_costs[rank] += costs[u]
    return [sorted(samples) for samples in assigned]


def rank_costs(lengths: list[int], assignment: list[list[int]], coefficient: float) -> list[float]:
    return [sum(sample_cost(lengths[i], coefficient) for i in samples) for samples in assignment]


def exchange_rows(
    rows: dict[str, Any], keep: list[int], num_rows: int, accelerator, unpadded_keys: Iterable[str] = ()
) -> dict[str, Any]:
    """This rank's new rows of TRL's rollout dict: ``keep`` indexes every rank's rows concatenated in rank order
    (``num_rows`` per rank; the same count after the move).

    A per-row tensor (first dimension ``num_rows``) with columns is padded to the widest rank's width (the
    prompt-aligned ones on the left, the completion-aligned ones on the right), except ``unpadded_keys`` (one value
    per row, such as a sequence-level importance ratio); then gathered, indexed, and trimmed to the columns the kept
    rows use (``prompt_mask``'s leading and ``completion_mask``'s trailing all-padding columns). 1D per-row tensors
    move as they are; everything else passes unchanged (``GLOBAL_KEYS``: the same on every rank)."""
    unpadded = set(unpadded_keys)
    index = torch.tensor(keep, dtype=torch.long)
    moved: dict[str, Any] = {}
    for key, value in rows.items():  # every rank holds the same keys in the same order (TRL builds them alike)
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.size(0) != num_rows:
            moved[key] = value
            continue
        tensor = value.to(torch.uint8) if value.dtype == torch.bool else value  # (gloo gathers no bool)
        if tensor.dim() >= 2 and key not in unpadded:
            pad = PAD_VALUES.get(key, 0)
            tensor = accelerator.pad_across_processes(tensor, dim=1, pad_index=pad, pad_first=key in PROMPT_ALIGNED)
        gathered = accelerator.gather(tensor.contiguous()).index_select(0, index.to(tensor.device))
        moved[key] = gathered.bool() if value.dtype == torch.bool else gathered
    return _trim(moved, unpadded)


def _trim(rows: dict[str, Any], unpadded: set[str]) -> dict[str, Any]:
    """Drop the columns no kept row uses (its rows need not be as wide as the widest rank's)."""
    prompt_mask, completion_mask = rows["prompt_mask"], rows["completion_mask"]
    used = prompt_mask.bool().any(dim=0).nonzero()
    prompt_start = int(used.min()) if used.numel() else prompt_mask.size(1) - 1
    used = completion_mask.bool().any(dim=0).nonzero()
    completion_end = int(used.max()) + 1 if used.numel() else 1
    padded_width = completion_mask.size(1)
    trimmed = {}
    for key, value in rows.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and key not in unpadded:
            if key in PROMPT_ALIGNED:
                value = value[:, prompt_start:]
            elif value.size(0) == prompt_mask.size(0) and value.size(1) == padded_width:
                value = value[:, :completion_end]
        trimmed[key] = value
    return trimmed
