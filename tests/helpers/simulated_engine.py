"""A test and benchmark helper: a simulated generation engine: log-normal completion times on a fixed number of slots, no model.

It answers the question asynchronous GRPO is about before a GPU is spent on it: with completions this uneven, how
close does an overlapped run come to ``max(generation, training)`` per step, and how much does ``max_staleness``
buy? ``benchmarks/async_grpo.py --simulated`` drives the real ``RolloutProducer`` with it; the tests use it to check
the producer's bound and order without a server.

Model: the engine runs at most ``slots`` groups at once (continuous batching, one slot per group); a group occupies
its slot for a time drawn from a log-normal distribution with the given mean and ``sigma``, from the request's seed,
so the same group takes the same time in every run. It serves the versions the trainer published (``publish``) and
answers with the one asked for, or raises if that version was never published.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass

from trlx_scale.rollout.async_producer import GroupRequest, SampledGroup


def lognormal_duration(seed: int, mean: float, sigma: float) -> float:
    """A log-normal time with the given mean (mu = log(mean) - sigma^2 / 2), drawn from ``seed``."""
    mu = math.log(mean) - sigma * sigma / 2
    return random.Random(seed).lognormvariate(mu, sigma)


@dataclass
class SimulatedEngine:
    """See the module docstring; times in seconds."""

    slots: int
    mean_group_time: float
    sigma: float = 1.0
    completion_length: int = 4

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be at least 1, got {self.slots}.")
        self._slots: asyncio.Semaphore | None = None
        self.published: set[int] = set()
        self.busy_time = 0.0

    def publish(self, version: int) -> None:
        self.published.add(version)

    def group_time(self, request: GroupRequest) -> float:
        return lognormal_duration(request.seed, self.mean_group_time, self.sigma)

    async def sample(self, request: GroupRequest) -> SampledGroup:
        if request.version not in self.published:
            raise RuntimeError(f"simulated engine: version {request.version} was never published.")
        if self._slots is None:  # created on the producer's loop
            self._slots = asyncio.Semaphore(self.slots)
        async with self._slots:
            duration = self.group_time(request)
            await asyncio.sleep(duration)
            self.busy_time += duration
        rng = random.Random(request.seed)
        completions = [
            [rng.randrange(100) for _ in range(self.completion_length)] for _ in range(request.num_generations)
        ]
        logprobs = [[-rng.random() for _ in ids] for ids in completions]
        return SampledGroup(completion_ids=completions, logprobs=logprobs, version=request.version)
