"""What a group's reward functions log through TRL's ``log_metric`` / ``log_extra``, kept with the group.

TRL hands reward functions ``log_metric(name, value)`` and ``log_extra(column, values)``, which append to the
trainer's pending logs for the rollout being scored. The asynchronous producer scores a group on its own thread, up
to ``max_staleness`` steps before the step that trains it: writing into the trainer's pending logs from there would
race with the trainer's own flush and report the values at the wrong step. So each group gets a ``GroupRewardLog``
that records the calls, and the trainer replays the logs of the groups it trains (on its thread, in the rollout's
order) right before TRL flushes them: the values land at the step that trains those completions, as in
``GRPOTrainer``. A checkpoint's rollout window keeps the groups' metrics; their ``log_extra`` columns (arbitrary
objects) are not saved, and a resumed run shows None there for the groups it restored.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

REWARD_LOG_KEY = "reward_log"  # the group's log in ``SampledGroup.extras``


@dataclass
class GroupRewardLog:
    """The ``log_metric`` / ``log_extra`` calls the reward functions made while scoring one group of ``size``
    completions (several functions may call at once: they run together in the scorer)."""

    size: int
    metrics: list[tuple[str, float]] = field(default_factory=list)
    extras: dict[str, list[Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def log_metric(self, name: str, value: float) -> None:
        with self._lock:
            self.metrics.append((name, float(value)))

    def log_extra(self, column: str, values: list) -> None:
        with self._lock:
            self.extras.setdefault(column, []).extend(values)


def replay_reward_logs(
    logs: Sequence[GroupRewardLog],
    log_metric: Callable[[str, float], None],
    log_extra: Callable[[str, list], None],
) -> None:
    """Hand the groups' logged values to the trainer's own ``log_metric`` / ``log_extra``, in the groups' order.

    A column that only some groups logged is padded with None for the others, so it stays aligned with the
    rollout's completions (TRL's completions table is one row per completion)."""
    for log in logs:
        for name, value in log.metrics:
            log_metric(name, value)
    for column in sorted({column for log in logs for column in log.extras}):
        values: list[Any] = []
        for log in logs:
            logged = log.extras.get(column, [])
            if len(logged) > log.size:
                raise ValueError(
                    f"a reward function logged {len(logged)} values of column '{column}' through log_extra for a "
                    f"group of {log.size} completions: log one value per completion."
                )
            values.extend(logged + [None] * (log.size - len(logged)))
        log_extra(column, values)
