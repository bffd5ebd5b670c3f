"""Rewards computed off the training loop, concurrently for every group in flight.

Synchronous GRPO scores a generation batch after the engine returns and before the loss, one reward function after
the other: a remote verifier or a code sandbox that takes a second per call then costs a second per function per
step, with the trainer and the engine both idle. The asynchronous producer scores each group as soon as it is
sampled, on its own event loop:

- reward functions written as coroutines (TRL accepts ``async def`` reward functions) are awaited together, for one
  group and across the groups in flight;
- synchronous ones run in a thread pool (``max_workers`` threads), so their latency overlaps too; a function that
  holds the GIL for its whole run (pure-Python arithmetic) gains nothing from threads, but remote calls and
  subprocesses, the slow kind, release it.

The call signature is TRL's: ``func(prompts=..., completions=..., completion_ids=..., **reward_kwargs)`` returns one
float (or None) per completion; None becomes NaN, as in TRL. A wrong count is an error that names the function.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trl.trainer.utils import get_callable_name, is_async_callable


class ConcurrentRewardScorer:
    """Scores one group's completions with every reward function, concurrently (see the module docstring)."""

    def __init__(self, reward_funcs: Sequence[Callable[..., Any]], max_workers: int = 8):
        if not reward_funcs:
            raise ValueError("reward_funcs is empty: give at least one reward function.")
        for func in reward_funcs:
            if not callable(func) or hasattr(func, "parameters"):
                raise TypeError(
                    f"reward function {func!r}: the asynchronous producer scores with callables (TRL's signature); "
                    "a reward model (nn.Module) is not supported there yet. Wrap it in a function."
                )
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}.")
        self.reward_funcs = list(reward_funcs)
        self.names = [get_callable_name(func) for func in self.reward_funcs]
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="trlx-scale-reward")

    async def score(
        self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **reward_kwargs: Any
    ) -> list[list[float]]:
        """Rewards as a (completions, functions) list of lists, NaN where a function returned None."""
        loop = asyncio.get_running_loop()
        kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **reward_kwargs}
        calls = []
        for func in self.reward_funcs:
            if is_async_callable(func):
                calls.append(func(**kwargs))
            else:
                calls.append(loop.run_in_executor(self._pool, functools.partial(func, **kwargs)))
        outputs = await asyncio.gather(*calls)
        columns = [
            self._column(name, output, len(completions)) for name, output in zip(self.names, outputs, strict=True)
        ]
        return [list(row) for row in zip(*columns, strict=True)]

    @staticmethod
    def _column(name: str, output: Any, expected: int) -> list[float]:
        values = [math.nan if value is None else float(value) for value in output]
        if len(values) != expected:
            raise ValueError(
                f"The reward function '{name}' returned {len(values)} rewards, but {expected} were expected (one per "
                "prompt-completion pair). Make sure the reward function returns exactly one reward per completion."
            )
        return values

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
