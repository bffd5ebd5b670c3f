"""Exclusive wall-clock timers for the phases of a training step.

A phase opened inside another pauses it: the weight sync inside generation counts as ``weight_sync`` only, and the
loss forward+backward around a rollout counts only its own time. So the phases of a step never overlap and their
sum plus ``other`` is the step's wall time (``trainer_profiling`` checks it). Counters (tokens, FLOPs) ride along so
that one ``take()`` returns everything a step measured.

The timer is single-threaded by design (one per process; the trainer's loop runs on one thread).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# Every phase a trainer may report, in the order of a step (also the column order of the cross-rank reduction, so
# every rank must use the same tuple). "other" is the rest of the step: data loading, logging, checkpoints, the
# learning-rate scheduler.
PHASES: tuple[str, ...] = (
    "generation",  # the engine's generate, wake and sleep included (HF generate without an engine)
    "weight_sync",  # trainer weights -> engine (LoRA-only or full)
    "reward",  # reward functions and reward models
    "old_logprobs",  # old-policy log-prob pass of a rollout
    "ref_logprobs",  # reference log-prob pass (per step; DPO's precomputed scoring is "ref_scoring")
    "critic",  # PPO: the critic's values over a rollout and its optimizer step
    "rollout",  # the rest of a rollout: decoding, gathers across ranks, advantages
    "loss_forward_backward",  # the loss pass: forward and backward of every micro-batch
    "optimizer",  # gradient clipping and norm, the optimizer step
    "ref_scoring",  # DPO: reference log-probs of the whole dataset, once before training
    "other",
)


class PhaseTimer:
    """Accumulates exclusive seconds per phase and counters until ``take()``.

    ``clock`` is injectable so that tests can drive time by hand. ``enabled=False`` makes every call a no-op.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, enabled: bool = True):
        self.clock = clock
        self.enabled = enabled
        self._stack: list[list] = []  # [name, resumed_at, absorbs_nested]
        self._seconds: dict[str, float] = defaultdict(float)
        self._counters: dict[str, float] = defaultdict(float)

    @property
    def current(self) -> str | None:
        """The innermost open phase."""
        return self._stack[-1][0] if self._stack else None

    def begin(self, name: str, absorb: bool = False) -> bool:
        """Open ``name``; returns False (and opens nothing) when it is already open or an enclosing phase absorbs
        nested ones. ``absorb=True``: phases opened inside count as this one (one-off passes like DPO's
        reference scoring, whose inner batches would otherwise report as per-step phases)."""
        if not self.enabled:
            return False
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; add it to trlx_scale.profiling.PHASES (known: {PHASES}).")
        if any(entry[0] == name or entry[2] for entry in self._stack):
            return False
        now = self.clock()
        if self._stack:
            parent = self._stack[-1]
            self._seconds[parent[0]] += now - parent[1]
        self._stack.append([name, now, absorb])
        return True

    def end(self, name: str) -> None:
        """Close ``name`` (the innermost open phase); its parent resumes. Closing a phase that is not open is a no-op
        (a callback may close what an exception already unwound)."""
        if not self._stack or self._stack[-1][0] != name:
            return
        now = self.clock()
        entry = self._stack.pop()
        self._seconds[name] += now - entry[1]
        if self._stack:
            self._stack[-1][1] = now

    @contextmanager
    def phase(self, name: str, absorb: bool = False) -> Iterator[None]:
        opened = self.begin(name, absorb=absorb)
        try:
            yield
        finally:
            if opened:
                # An exception may leave inner phases open (a callback that never ran): close down to this one.
                while self._stack and self._stack[-1][0] != name:
                    self.end(self._stack[-1][0])
                self.end(name)

    def count(self, name: str, value: float) -> None:
        """Add ``value`` to counter ``name`` (tokens, FLOPs) for the current step."""
        if self.enabled:
            self._counters[name] += float(value)

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        """(seconds per phase, counters) since the last take; open phases are split at now and keep running."""
        if self._stack:  # only the innermost phase is running
            now = self.clock()
            self._seconds[self._stack[-1][0]] += now - self._stack[-1][1]
            self._stack[-1][1] = now
        seconds, counters = dict(self._seconds), dict(self._counters)
        self._seconds.clear()
        self._counters.clear()
        return seconds, counters
