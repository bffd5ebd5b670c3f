"""What a reward worker process runs (``rollout/reward_processes.py``): one call of a reward function, its rewards or
its exception, and the ``log_metric`` / ``log_extra`` calls it made, for the trainer's process to replay.

Standard library only, and outside ``trlx_scale.rollout`` (whose package imports transformers): a spawned worker
imports this module to find its task, and starts in about a second instead of the several that importing
transformers and TRL takes.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Sequence
from typing import Any


def _record(calls: list, name: str, *args: Any, **kwargs: Any) -> None:
    calls.append((name, args, kwargs))


def sendable(error: Exception) -> Exception:
    """``error`` if it survives pickling (an exception the trainer's process cannot unpickle breaks the pool)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure to round-trip means: send a plain description instead
        return RuntimeError(f"{type(error).__name__}: {error}")


def score_in_worker(func: Callable, kwargs: dict[str, Any], callbacks: Sequence[str]) -> tuple:
    """In the worker: the function's rewards (or its exception) and the log calls it made, on stand-ins named
    ``callbacks``."""
    calls: list = []
    for name in callbacks:
        kwargs[name] = functools.partial(_record, calls, name)
    try:
        rewards = func(**kwargs)
    except Exception as error:  # noqa: BLE001 - raised again in the trainer's process, after the log calls
        return None, calls, sendable(error)
    return (None if rewards is None else list(rewards)), calls, None
