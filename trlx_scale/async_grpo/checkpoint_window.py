"""``AsyncGRPOTrainer``'s checkpoints carry the staleness window (``rollout.rollout_window``): each rank saves the
groups sampled (or admitted) by versions older than the checkpoint's weights, and a resumed run continues the
interrupted run's schedule from them when its settings are the same.

A preemption waits for the window at most what is left of ``preemption_grace_period``; if a rank's window is still
incomplete then, every rank saves none, so the ranks' schedules agree.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..reliability.rank_agreement import failing_together
from ..rollout.async_producer import RolloutProducer
from ..rollout.rollout_window import WINDOW_STATE_NAME, load_window, save_window, window_mismatch
from ..trainer_part import TrainerPart

logger = logging.getLogger(__name__)


class RolloutWindowCheckpoint(TrainerPart):
    """``AsyncGRPOTrainer``'s checkpoint part (``reliability.checkpoint_parts``): the rollout window saved with each
    checkpoint, and continued on resume when the engine starts (``continued_window``)."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        self._resume_window: tuple[dict[str, int], list] | None = None  # read from a checkpoint on resume

    def window_settings(self, groups: int, next_index: int, oldest_version: int) -> dict[str, int]:
        """What decides the schedule and the samples: a saved window continues a run only if they are the same."""
        trainer = self.trainer
        settings = {
            "seed": trainer.args.seed,
            "world_size": trainer.accelerator.num_processes,
            "num_generations": trainer.num_generations,
            "groups_per_version": groups,
            "max_staleness": trainer.args.max_staleness,
            "weight_sync_steps": trainer.args.weight_sync_steps,
            "next_index": next_index,
            "oldest_version": oldest_version,
        }
        if trainer.args.dynamic_sampling:  # absent: off, as in windows saved before it existed
            settings["dynamic_sampling_max_rounds"] = trainer.args.dynamic_sampling_max_rounds
            settings["dynamic_sampling_min_std"] = trainer.args.dynamic_sampling_min_std
        if trainer.args.optimizer_steps_per_rollout != 1:  # absent: 1, as in windows saved before it could be more
            settings["optimizer_steps_per_rollout"] = trainer.args.optimizer_steps_per_rollout
        return settings

    def continued_window(self, groups: int, start_index: int) -> tuple[int, list]:
        """The oldest version and the groups queued first: a resumed run continues its checkpoint's window (the
        interrupted run's schedule, bit for bit); without one (a fresh run, a checkpoint saved with
        save_only_model, changed settings) the servers start from the checkpoint's weights alone."""
        start = start_index // groups
        if self._resume_window is None:
            return start, []
        saved, window = self._resume_window
        self._resume_window = None
        why = window_mismatch(saved, self.window_settings(groups, start_index, saved["oldest_version"]))
        if why is not None:
            logger.warning(
                "The checkpoint's rollout window does not fit this run (%s): the groups the interrupted run had "
                "sampled from older versions are sampled again from the checkpoint's weights.",
                why,
            )
            return start, []
        return int(saved["oldest_version"]), window

    def save(self, checkpoint_dir: str) -> None:
        """Each rank saves its staleness window: the groups sampled (or admitted) by versions older than the
        checkpoint's weights, waited for first (``rollout.rollout_window``)."""
        trainer = self.trainer
        engine = trainer.vllm_generation
        if engine is None:  # no rollout yet: nothing was sampled
            return
        # The window is the one the checkpoint's version admits once it is served; a preemption waits for the update
        # at most what is left of its grace period (one still landing then: its groups are sampled again on resume).
        since = trainer.checkpoints.seconds_since_preemption()
        engine.finish_delivery(None if since is None else max(0.0, trainer.args.preemption_grace_period - since))
        groups, oldest = self._checkpoint_window(engine.producer)
        settings = self.window_settings(trainer._schedule.groups_per_version, engine.producer.next_index, oldest)
        path = os.path.join(checkpoint_dir, WINDOW_STATE_NAME.format(trainer.accelerator.process_index))
        save_window(path, groups, settings)

    def _checkpoint_window(self, producer: RolloutProducer) -> tuple[list, int]:
        """The groups a checkpoint carries and the oldest version its schedule continues from. A regular save waits
        for every admitted group (up to request_timeout). A preemption's waits what is left of
        ``preemption_grace_period``; if any rank's window is still incomplete then, every rank saves none (their
        schedules must agree): the resumed run samples those groups again, seeded as before, from the checkpoint's
        weights, and the requests in flight are cancelled when training stops."""
        trainer = self.trainer
        since = trainer.checkpoints.seconds_since_preemption()
        what = "waiting for the rollout window of the checkpoint"
        if since is None:
            with failing_together(trainer.accelerator, what):
                return producer.admitted_groups(timeout=trainer.args.request_timeout), trainer._schedule.oldest_version
        grace = max(0.0, trainer.args.preemption_grace_period - since)
        with failing_together(trainer.accelerator, what):
            groups = producer.admitted_groups(timeout=grace, partial=True)
            missing = producer.admitted_count() - len(groups)
        if not trainer.checkpoints.any_rank(missing > 0):
            return groups, trainer._schedule.oldest_version
        logger.warning(
            "Preempted: %d of this rank's groups were still in flight after the %.0f s grace period "
            "(preemption_grace_period); they are cancelled, and the resumed run samples them again from the "
            "checkpoint's weights.",
            missing,
            trainer.args.preemption_grace_period,
        )
        return [], -(
            -trainer.state.global_step // trainer.args.optimizer_steps_per_rollout
        )  # the next rollout's weights

    def load(self, checkpoint_dir: str) -> None:
        trainer = self.trainer
        path = os.path.join(checkpoint_dir, WINDOW_STATE_NAME.format(trainer.accelerator.process_index))
        if os.path.isfile(path):
            self._resume_window = load_window(path)
        elif trainer.args.max_staleness > 0:
            logger.warning(
                "%s is missing: the groups the interrupted run had sampled from older versions are sampled again "
                "from the checkpoint's weights (inside the bound, not bit for bit the interrupted run).",
                path,
            )
