"""Online DPO on several processes: every rank trains on the same number of pairs, and the gradient is exactly the
mean over all real pairs of the step, as on one process.

Each rank samples and ranks its own prompts, so ranks end up with different numbers of (chosen, rejected) pairs
(a prompt whose samples all score the same gives none), while TRL's loss gathers per-pair tensors across ranks and
needs equal shapes. Here the pairs of all ranks are gathered (one object gather), cut into ``ceil(P / W)`` per rank
in rank order, and the last ranks are topped up with *tie pairs*: a real pair's chosen completion as both chosen and
rejected. A tie pair's chosen and rejected rows are the same tokens, so their scores are equal as functions of the
weights: the pair adds a constant to the loss and nothing to the gradient, for every loss TRL computes from the
chosen-rejected difference (``TIE_SAFE_LOSS_TYPES``). Each rank's loss is then scaled by ``W * m / P`` (m rows per
rank, P real pairs in all) so that DDP's (or ZeRO's) average of the ranks' means is the mean over the P real pairs,
and the tie pairs' constant (``tie_pair_loss``) is subtracted so that the logged loss is that mean too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# TRL loss types whose per-pair loss depends on the weights only through the chosen-rejected score difference.
TIE_SAFE_LOSS_TYPES = ("sigmoid", "hinge", "ipo")


@dataclass(frozen=True)
class BalancedPairs:
    pairs: list[dict]  # this rank's rows: real pairs, then tie pairs
    loss_scale: float  # W * m / P: makes the mean over ranks the mean over real pairs
    padding: int  # tie pairs on this rank
    total: int  # real pairs over all ranks
    total_padding: int  # tie pairs over all ranks (the same number on every rank: what the logs show)


def tie_pair_loss(loss_types: list[str], loss_weights: list[float] | None, beta: float) -> float:
    """The loss TRL gives a tie pair (score difference 0): subtracted from the logged loss, which then equals the
    mean over real pairs. A constant, so the gradient is unchanged."""
    per_type = {"sigmoid": math.log(2.0), "hinge": 1.0, "ipo": (1.0 / (2.0 * beta)) ** 2}
    weights = loss_weights or [1.0] * len(loss_types)
    return sum(weight * per_type[loss_type] for loss_type, weight in zip(loss_types, weights, strict=True))


def check_multi_process_online_loss(loss_types: list[str], use_weighting: bool) -> None:
    """Tie pairs are exact only for difference-based losses without per-sequence weights."""
    unsafe = [t for t in loss_types if t not in TIE_SAFE_LOSS_TYPES]
    if unsafe:
        raise ValueError(
            f"online=True on several processes balances the ranks' pairs with tie pairs, which are exact only for "
            f"loss_type in {TIE_SAFE_LOSS_TYPES}; got {unsafe}. Use one of those, or train online DPO on one process."
        )
    if use_weighting:
        raise ValueError(
            "online=True on several processes cannot use use_weighting=True (a tie pair's weight would carry a "
            "gradient); set use_weighting=False."
        )


def balance_pairs(all_pairs: list[dict], rank: int, world: int) -> BalancedPairs:
    """This rank's share of ``all_pairs`` (every rank's pairs, in rank order), topped up with tie pairs."""
    total = len(all_pairs)
    if total == 0:
        return BalancedPairs(pairs=[], loss_scale=1.0, padding=0, total=0, total_padding=0)
    per_rank = math.ceil(total / world)
    mine = list(all_pairs[rank * per_rank : (rank + 1) * per_rank])
    template = mine[0] if mine else all_pairs[0]
    tie = {
        "prompt_ids": list(template["prompt_ids"]),
        "chosen_ids": list(template["chosen_ids"]),
        "rejected_ids": list(template["chosen_ids"]),
    }
    padding = per_rank - len(mine)
    return BalancedPairs(
        pairs=mine + [dict(tie) for _ in range(padding)],
        loss_scale=world * per_rank / total,
        padding=padding,
        total=total,
        total_padding=world * per_rank - total,
    )
