"""Synchronous reward functions in worker processes (``AsyncGRPOConfig.async_reward_processes``).

A reward function that computes in Python (parsing, math verification, a small simulator) holds the GIL for its
whole run. Run by the asynchronous producer in a thread of the trainer's process, it takes the interpreter from the
training loop: between two kernels, each of the trainer's Python steps waits for the reward's time slice. In a
worker process it has an interpreter of its own.

How a call travels:

- the reward guard (``reliability/reward_guard.py``) stays in the trainer's process, around a
  ``ProcessRewardFunction``: ``reward_errors``, non-finite rewards and the per-sample search for a failing sample
  work as with threads (each retried sample goes to a worker too);
- the function and its arguments are pickled to a worker of a pool of ``spawn`` processes: a function by reference
  (its module and name), a ``functools.partial`` or a callable instance by value, so state a call changes stays in
  the worker; the arguments include TRL's ``trainer_state`` snapshot, whose ``log_history`` grows with the run;
- the scorer's thread waits for the answer without holding the GIL;
- TRL's ``log_metric`` / ``log_extra`` arguments cannot cross a process: the worker records the calls made on
  stand-ins, and the trainer's process replays them, in order, on the real ones (also those made before the function
  raised);
- an exception raised in the worker is raised in the trainer's process (as a ``RuntimeError`` naming its type where
  it cannot be pickled back);
- a worker that dies (killed, out of memory) or a pool stopped under a call raises ``RewardScoringUnavailable``,
  which the guard does not retry sample by sample: the producer stops the run with it. A dead pool is replaced at
  the next call.

What a worker cannot take is refused when the trainer is built, naming the function: one defined in the training
script itself (``__main__``: a worker would run the script's top level to find it), a lambda or a closure (not
picklable), and runs with ``environment_factory`` or a ``GymRollout`` (a reward that reads an environment would read
a copy; a GymRollout's own reward columns are closures). Each worker starts at the first rollout and imports the
training script's modules (seconds, once per run): as with any library that starts ``spawn`` workers, the script must
start training under ``if __name__ == "__main__":`` (the examples and ``trlx-scale`` do).
"""

from __future__ import annotations

import multiprocessing
import pickle
import pickletools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import BrokenExecutor, CancelledError, Future, ProcessPoolExecutor
from typing import Any

from trl.trainer.utils import get_callable_name

from ..reliability.reward_guard import GuardedRewardFunction, RewardScoringUnavailable
from ..reward_worker import score_in_worker

# TRL's reward-function arguments that are callables of the trainer's process: replayed there, not sent.
_LOG_CALLBACKS = ("log_metric", "log_extra")


def _stop(pool: ProcessPoolExecutor) -> None:
    """Shut ``pool`` down without waiting, and end its workers: a reward stuck in one must not hold the trainer's
    exit (the interpreter joins a pool's busy workers at exit). Python 3.14 has ``terminate_workers``; before it, the
    pool's process table (CPython's ``_processes``) is the only handle on them. tests/test_reward_processes.py fails
    if a busy worker outlives ``close``."""
    if hasattr(pool, "terminate_workers"):
        pool.terminate_workers()
        return
    workers = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        if worker.is_alive():
            worker.terminate()


class RewardProcessPool:
    """``processes`` spawned workers shared by every wrapped function: started at the first call, replaced when one
    dies, stopped by ``close`` (calls then raise) until ``open``."""

    def __init__(self, processes: int):
        if processes < 1:
            raise ValueError(f"a reward process pool needs at least 1 process, got {processes}.")
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._open = True
        self._lock = threading.Lock()  # the producer's threads submit concurrently

    def open(self) -> None:
        with self._lock:
            self._open = True

    @property
    def is_open(self) -> bool:
        return self._open

    def submit(self, *args: Any) -> tuple[ProcessPoolExecutor, Future]:
        with self._lock:
            if not self._open:
                raise RewardScoringUnavailable(
                    "the reward worker processes were stopped (the run ended) before this reward was scored."
                )
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
            pool = self._pool
        try:
            return pool, pool.submit(*args)
        except BrokenExecutor:  # a worker died since the last call
            self.replace(pool)
            raise

    def replace(self, broken: ProcessPoolExecutor) -> None:
        """A pool whose worker died takes no more calls: the next call starts a new one."""
        with self._lock:
            if self._pool is broken:
                self._pool = None
        _stop(broken)

    def close(self) -> None:
        with self._lock:
            pool, self._pool, self._open = self._pool, None, False
        if pool is not None:
            _stop(pool)


class ProcessRewardFunction:
    """``func`` (TRL's reward signature, synchronous) called in a worker of ``pool``."""

    def __init__(self, func: Callable, pool: RewardProcessPool):
        # Not ``functools.update_wrapper``, nor an attribute named ``func``: a guard built around this object copies
        # its ``__dict__`` (update_wrapper), and would take a ``func`` it found there for its own.
        self.function = func
        self.pool = pool
        self.__name__ = get_callable_name(func)  # TRL names the reward's metrics after it
        self.__doc__ = getattr(func, "__doc__", None)

    def __call__(self, **kwargs: Any) -> list | None:
        callbacks = {name: kwargs.pop(name) for name in _LOG_CALLBACKS if name in kwargs}
        try:
            executor, future = self.pool.submit(score_in_worker, self.function, kwargs, tuple(callbacks))
            try:
                rewards, calls, error = future.result()
            except BrokenExecutor:
                self.pool.replace(executor)
                raise
        except BrokenExecutor as failure:
            if not self.pool.is_open:  # close() ended the worker under this call
                raise RewardScoringUnavailable(
                    f"reward function '{self.__name__}': the reward worker processes were stopped (the run ended) "
                    "under this call."
                ) from failure
            raise RewardScoringUnavailable(
                f"reward function '{self.__name__}': its worker process stopped (killed, out of memory, or it could "
                'not start: the training script must start training under `if __name__ == "__main__":`). Set '
                "async_reward_processes=0 to score in threads."
            ) from failure
        except CancelledError as failure:
            raise RewardScoringUnavailable(
                f"reward function '{self.__name__}': the reward worker processes were stopped (the run ended) under "
                "this call."
            ) from failure
        for name, args, call_kwargs in calls:
            callbacks[name](*args, **call_kwargs)
        if error is not None:
            raise error
        return rewards


def _refers_to_main(payload: bytes) -> bool:
    """Whether a pickle names something of ``__main__`` (the training script): a string operand equal to it."""
    return any(argument == "__main__" for _, argument, _ in pickletools.genops(payload))


def check_sendable(func: Callable, field_name: str) -> None:
    """Refuse, naming the function and ``field_name``, a reward function a spawned worker cannot import."""
    name = get_callable_name(func)
    try:
        payload = pickle.dumps(func)
    except Exception as error:  # noqa: BLE001 - pickle raises several types; each is the same refusal
        raise ValueError(
            f"{field_name}: the reward function '{name}' cannot be sent to a worker process ({error}). Define it at "
            f"the top level of a module (not a lambda or a closure), or set {field_name}=0."
        ) from error
    if _refers_to_main(payload):
        raise ValueError(
            f"{field_name}: the reward function '{name}' is defined in the training script (__main__): a worker "
            f"process would run the script's top level to find it. Move it into a module beside the script and "
            f"import it from there, or set {field_name}=0."
        )


def send_reward_functions_to_processes(
    reward_funcs: Sequence[Any], processes: int, environment_factory: Any, rollout_func: Any, field_name: str
) -> RewardProcessPool | None:
    """Run each guarded synchronous function of ``reward_funcs`` (``GuardedRewardFunction``: its guard stays here) in
    a shared pool of ``processes`` workers; None and nothing changed when ``processes`` is 0. Async functions are
    awaited on the producer's loop as before. A run with environments (``environment_factory``) or its own rollout
    (``rollout_func``: a GymRollout, whose reward columns are closures over its episodes) is refused."""
    if processes == 0:
        return None
    if environment_factory is not None or rollout_func is not None:
        given = "environment_factory" if environment_factory is not None else "rollout_func (a GymRollout)"
        raise ValueError(
            f"{field_name}={processes} with {given}: rewards that read environments or episodes are scored in the "
            f"trainer's process. Set {field_name}=0."
        )
    guarded = [func for func in reward_funcs if isinstance(func, GuardedRewardFunction)]
    for guard in guarded:
        check_sendable(guard.func, field_name)
    pool = RewardProcessPool(processes)
    for guard in guarded:
        guard.func = ProcessRewardFunction(guard.func, pool)
    return pool
