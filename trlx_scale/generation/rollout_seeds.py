"""Per-request sampling seeds: a rollout is a function of (seed, step, prompt), not of the engine's history.

vLLM draws from one engine-wide generator unless a request carries its own ``seed``. With the engine-wide one, the
samples of step N depend on every request the engine served before, so a run resumed from a checkpoint at step N
(a new process, a fresh engine) samples different completions than the uninterrupted run would have, and drifts.
Seeding each request from (the run's seed, the data-parallel rank, the step, train/eval, the prompt's tokens, and
which occurrence of that prompt in the batch it is) makes step N's samples the same in both.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutSeedContext:
    """Where a batch of requests comes from: the run's seed, the data-parallel rank, the step and the mode."""

    seed: int
    rank: int
    step: int
    mode: str = "train"


def request_seed(context: RolloutSeedContext, prompt_token_ids: Sequence[int], occurrence: int) -> int:
    """A 63-bit seed for one request; ``occurrence`` tells apart requests with the same prompt in one batch."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{context.seed}|{context.rank}|{context.step}|{context.mode}|{occurrence}|".encode())
    digest.update(",".join(map(str, prompt_token_ids)).encode())
    return int.from_bytes(digest.digest(), "big") >> 1
