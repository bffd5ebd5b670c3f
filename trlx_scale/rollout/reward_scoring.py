"""The reward scorer of every trainer: reward functions run concurrently, with TRL's signature.

TRL scores a generation batch one reward function after the other: a remote verifier or a code sandbox that takes a
second per call then costs a second per function per step, with the trainer and the engine both idle. Here:

- the asynchronous producer scores each group as soon as it is sampled, on its own event loop (``score``);
- the synchronous trainers (``GRPOTrainer``, ``PPOTrainer``, online ``DPOTrainer``) score a rollout from the
  trainer's thread (``score_now``), on the scorer's own event loop. A single synchronous function runs on the
  trainer's thread itself, as in TRL (nothing to overlap, and a function that needs the main thread, such as one that
  sets ``signal.alarm``, keeps working).

Either way:

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
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trl.trainer.utils import get_callable_name, is_async_callable

# The columns of a rollout's rows that TRL passes under other names (prompts, completions, completion_ids), not as
# keyword columns.
TRL_REWARD_INPUTS = ("prompt", "completion", "completion_ids")


def rollout_reward_scorer(reward_funcs: Sequence[Any], mode: str = "concurrent") -> ConcurrentRewardScorer | None:
    """The scorer of a synchronous trainer's rollouts (``reward_scoring``): one thread per function (a rollout is
    scored at once, so more gain nothing); None where TRL's own loop scores them: ``mode="sequential"``, no function
    to run, or a reward model among them (an ``nn.Module`` scored on the trainer's device)."""
    if mode == "sequential" or not reward_funcs or any(hasattr(func, "parameters") for func in reward_funcs):
        return None
    return ConcurrentRewardScorer(reward_funcs, max_workers=len(reward_funcs))


class ConcurrentRewardScorer:
    """Scores one group's completions with every reward function, concurrently (see the module docstring)."""

    def __init__(self, reward_funcs: Sequence[Callable[..., Any]], max_workers: int = 8, sequential: bool = False):
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
        self._max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None  # made at first use, and again after close()
        # score_now only: every function in turn, the synchronous ones on the caller's thread (reward_scoring).
        self.sequential = sequential
        self._loop: asyncio.AbstractEventLoop | None = None  # score_now's, started at its first call
        self._loop_thread: threading.Thread | None = None

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
                calls.append(loop.run_in_executor(self._executor(), functools.partial(func, **kwargs)))
        outputs = await asyncio.gather(*calls)
        columns = [
            self._column(name, output, len(completions)) for name, output in zip(self.names, outputs, strict=True)
        ]
        return [list(row) for row in zip(*columns, strict=True)]

    def score_now(
        self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **reward_kwargs: Any
    ) -> list[list[float]]:
        """``score`` from a thread with no running event loop (a synchronous trainer's), blocking until done."""
        if self.sequential or (len(self.reward_funcs) == 1 and not is_async_callable(self.reward_funcs[0])):
            kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids}
            columns = []
            for name, func in zip(self.names, self.reward_funcs, strict=True):
                if is_async_callable(func):
                    output = self._run_on_loop(func(**kwargs, **reward_kwargs))
                else:
                    output = func(**kwargs, **reward_kwargs)
                columns.append(self._column(name, output, len(completions)))
            return [list(row) for row in zip(*columns, strict=True)]
        return self._run_on_loop(self.score(prompts, completions, completion_ids, **reward_kwargs))

    def _run_on_loop(self, coroutine: Any) -> Any:
        """Await ``coroutine`` on the scorer's own event loop (a daemon thread, started at the first call)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(
                target=self._loop.run_forever, name="trlx-scale-reward-loop", daemon=True
            )
            self._loop_thread.start()
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    @staticmethod
    def _column(name: str, output: Any, expected: int) -> list[float]:
        values = [math.nan if value is None else float(value) for value in output]
        if len(values) != expected:
            raise ValueError(
                f"The reward function '{name}' returned {len(values)} rewards, but {expected} were expected (one per "
                "prompt-completion pair). Make sure the reward function returns exactly one reward per completion."
            )
        return values

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="trlx-scale-reward")
        return self._pool

    def close(self) -> None:
        """Stop the worker threads and the event loop's thread. The scorer stays usable: a later call starts them
        again (a synchronous trainer closes its scorer at the end of each ``train()``)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=5)
            self._loop.close()
            self._loop = self._loop_thread = None
