"""Reward functions for tests/test_reward_processes.py, at the top level of a module as a worker process needs them
(it imports them by name). Light imports only: a spawned worker imports this module."""

from __future__ import annotations

import os
import time


def worker_pid_reward(prompts, completions, log_metric, log_extra, **kwargs) -> list[float]:
    """Each completion's length; logs the process it ran in and one note per completion."""
    log_metric("worker_pid", float(os.getpid()))
    log_extra("worker_note", [f"scored {len(completions)}"] * len(completions))
    return [float(len(completion)) for completion in completions]


def failing_on_x_reward(prompts, completions, **kwargs) -> list[float | None]:
    """1.0 per completion; raises ValueError on a batch holding a completion "x" (the guard then scores one by one)."""
    if "x" in completions:
        raise ValueError("cannot score 'x'")
    return [1.0] * len(completions)


def dying_reward(prompts, completions, **kwargs) -> list[float]:
    """Ends its worker process (as the OOM killer would)."""
    os._exit(1)


def slow_reward(prompts, completions, **kwargs) -> list[float]:
    time.sleep(30)
    return [0.0] * len(completions)


class _TwoArgumentError(Exception):
    """An exception that pickles but cannot be unpickled (its __init__ takes two arguments)."""

    def __init__(self, what, where):
        super().__init__(f"{what} at {where}")


def logging_then_failing_reward(prompts, completions, log_metric, **kwargs) -> list[float]:
    log_metric("before_failing", 1.0)
    raise _TwoArgumentError("no score", "sample 0")
