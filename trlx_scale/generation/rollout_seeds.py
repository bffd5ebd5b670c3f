"""Per-request sampling seeds: a rollout is a function of (seed, step, prompt), not of the engine's history.

vLLM draws from one engine-wide generator unless a request carries its own ``seed``. With the engine-wide one, the
samples of step N depend on every request the engine served before, so a run resumed from a checkpoint at step N
(a new process, a fresh engine) samples different completions than the uninterrupted run would have, and drifts.
Seeding each request from (the run's seed, the step, train/eval, the request's row in the step's *global* batch, and
the prompt's tokens) makes step N's samples the same in both; and, since the row is global (rank x rows per rank +
local row), the same on 1 process x B rows as on 2 processes x B/2, as long as no group of a prompt's samples is
split between two ranks (then the two halves are two requests instead of one).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutSeedContext:
    """Where a batch of requests comes from: the run's seed, the data-parallel rank (its rows follow those of the
    ranks before it in the global batch), the step and the mode."""

    seed: int
    rank: int
    step: int
    mode: str = "train"


def request_seed(context: RolloutSeedContext, prompt_token_ids: Sequence[int], global_row: int) -> int:
    """A 63-bit seed for one request: the one starting at ``global_row`` of the step's global batch."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{context.seed}|{context.step}|{context.mode}|{global_row}|".encode())
    digest.update(",".join(map(str, prompt_token_ids)).encode())
    return int.from_bytes(digest.digest(), "big") >> 1


def turn_seed(seed: int, turn: int) -> int:
    """A 63-bit request seed for turn ``turn`` of the trajectory seeded ``seed``."""
    digest = hashlib.blake2b(f"{seed}|turn|{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
