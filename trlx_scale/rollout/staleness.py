"""Bounded staleness by admission control: when a rollout group may start, and which policy version samples it.

Asynchronous GRPO overlaps generation with training, so a group may be sampled by weights some optimizer steps older
than the ones it is trained with. The bound is kept by admission control, as AReaL and SkyRL do, not by dropping
stale groups at dequeue as TRL's ``AsyncGRPOTrainer`` does: dropping and re-queueing starves the slow, hard prompts
(their long completions are the ones that come back too old), while admission never starts a group that could end up
too stale, so nothing is dropped and no prompt is favoured.

The schedule, in numbered steps (``w``: ``weight_sync_steps``, ``s``: ``max_staleness``, ``g``: groups consumed per
policy version):

1. Groups are numbered in the order the trainer consumes them: group ``k`` is trained at policy version
   ``t(k) = start_version + (k - start_index) // g`` (the trainer consumes ``g`` groups, then its optimizer step makes
   the next version).
2. The server receives the weights of every ``w``-th version only, so a group can be sampled by a version ``v`` that
   is a multiple of ``w`` and at most ``t(k)`` (weights from the future do not exist). The bound asks
   ``t(k) - v <= s``. The most on-policy choice that also overlaps the most is the *oldest* admissible one: the first
   multiple of ``w`` that is at least ``t(k) - s``. It is at most ``t(k)`` when ``s >= w - 1`` (checked).
3. Group ``k`` starts as soon as that version is on the server (the trainer publishes it after each weight sync), and
   is sampled by exactly that version: with one adapter per version on the server (LoRA), the request names it, so the
   version is a function of ``k`` alone and a run is reproducible whatever the timing. A server that holds only its
   latest weights (full-weight sync) samples with a version at least as new: fresher, still inside the bound.

A resumed run continues the interrupted run's schedule: its checkpoint carries the groups sampled by versions older
than its weights (``rollout_window``), and every later group is sampled by a version the resumed run syncs. Without
that window (a checkpoint saved with ``save_only_model``, or changed settings) the run starts from one version, its
checkpoint's (``oldest_version``): the groups the interrupted run had sampled from older versions are sampled from it
instead (fresher, inside the bound); from ``max_staleness`` steps after the resume on, the schedule is the
uninterrupted run's.

``max_staleness=0`` (with ``w=1``) makes ``v = t(k)``: a group starts only once the weights it is trained with exist,
which is synchronous GRPO.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessSchedule:
    """Which version samples group ``k`` and when it may start (see the module docstring)."""

    groups_per_version: int
    max_staleness: int
    weight_sync_steps: int = 1
    start_index: int = 0
    start_version: int = 0
    oldest_version: int = 0

    def __post_init__(self) -> None:
        if self.groups_per_version < 1:
            raise ValueError(f"groups_per_version must be at least 1, got {self.groups_per_version}.")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}.")
        if self.weight_sync_steps < 1:
            raise ValueError(f"weight_sync_steps must be at least 1, got {self.weight_sync_steps}.")
        if self.max_staleness < self.weight_sync_steps - 1:
            raise ValueError(
                f"max_staleness ({self.max_staleness}) must be at least weight_sync_steps - 1 "
                f"({self.weight_sync_steps - 1}): with weights sent every {self.weight_sync_steps} steps, the steps "
                "between two syncs train on samples that old. Raise max_staleness or lower weight_sync_steps."
            )

    def trained_at(self, index: int) -> int:
        """The policy version that trains group ``index``."""
        if index < self.start_index:
            raise ValueError(f"group {index} was consumed before this schedule's start ({self.start_index}).")
        return self.start_version + (index - self.start_index) // self.groups_per_version

    def sampled_at(self, index: int) -> int:
        """The version that samples group ``index``: the oldest synced version within the bound, never before
        ``oldest_version`` (a resumed run has only its checkpoint's weights: the first groups are sampled fresher)."""
        oldest = self.trained_at(index) - self.max_staleness
        if oldest <= self.oldest_version:  # the first version on the servers (0, or the resumed checkpoint's)
            return self.oldest_version
        step = self.weight_sync_steps
        return -(-oldest // step) * step

    def may_start(self, index: int, published_version: int | None) -> bool:
        """Whether group ``index`` may start once the server holds ``published_version`` (None: nothing yet)."""
        return published_version is not None and published_version >= self.sampled_at(index)

    def staleness(self, index: int, sampled_version: int) -> int:
        """How many versions older than the trainer's the sampling weights of group ``index`` are."""
        return self.trained_at(index) - sampled_version

    def check(self, index: int, sampled_version: int) -> None:
        """Raise if group ``index`` came back sampled by a version outside the bound (from the future, or too old):
        the server did not serve what the producer asked for."""
        staleness = self.staleness(index, sampled_version)
        if not 0 <= staleness <= self.max_staleness:
            raise RuntimeError(
                f"group {index} (trained at version {self.trained_at(index)}) was sampled by version {sampled_version}: "
                f"staleness {staleness} is outside [0, max_staleness={self.max_staleness}]. The server served other "
                "weights than the ones the producer asked for."
            )
