"""``GroupReplacement``: how the asynchronous producer replaces a group that teaches nothing (dynamic sampling).

``AsyncGRPOTrainer`` trains each step on its groups ("slots", numbered in consumption order: the staleness schedule's
group indices). With dynamic sampling on, the producer scores a slot's group as soon as it is sampled; a group whose
rewards carry no signal (``keeps`` says no) is dropped and the slot is sampled again with another prompt, until a
group is kept or ``max_attempts`` groups were sampled (the last one is then trained on, and counted as unfilled), so
the producer keeps admitting groups until the step's quota of informative ones is met. In numbered steps:

1. Attempt ``a`` of slot ``k`` samples ``prompt_for(original prompt, a)`` (``a`` = 0: the data loader's prompt; later
   attempts: a replacement that is a function of ``k`` and ``a`` alone), with the request seed of the slot mixed
   with ``a`` (``attempt_seed``): what a slot trains on does not depend on timing, and a resumed run samples it again
   bit for bit.
2. Every attempt is sampled by the version the schedule gives the slot (``StalenessSchedule.sampled_at(k)``) and
   checked against the bound like any group: a replacement is never staler than the group it replaces, and the
   dropped groups leave the schedule's numbering (which version trains which slot) unchanged.
3. The attempts run inside the slot's task, so they hold one of ``max_inflight_tasks`` and the groups behind them keep
   being sampled meanwhile; the slot is ready (``take``) once a group is kept.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GroupReplacement:
    """Whether a scored group is kept, and the prompt of a slot's later attempts (see the module docstring)."""

    keeps: Callable[[list[list[float]]], bool]  # a group's rewards (completions, functions) -> whether it is kept
    prompt_for: Callable[[Any, int], Any]  # (the slot's first prompt, attempt >= 1) -> that attempt's prompt
    max_attempts: int
    # A dropped group's tokens as TRL's num_tokens counts a generation call's (the prompt's and the sampled ones).
    token_count: Callable[[Any], int] = lambda sampled: 0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1 (the slot's first group), got {self.max_attempts}.")


def attempt_seed(seed: int, attempt: int) -> int:
    """The request seed of a slot's attempt ``attempt``: the slot's own for the first, a 63-bit mix for the others
    (a replacement prompt may be the slot's first prompt again; its completions should not be the dropped ones)."""
    if attempt == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}|attempt|{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
