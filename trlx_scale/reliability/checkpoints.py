"""Checkpoints that count only once complete.

transformers writes ``checkpoint-N/`` in place, file by file, and ``resume_from_checkpoint=True`` picks the newest
directory: a process killed mid-save leaves a torn checkpoint that the next run resumes from (or crashes on). Here a
checkpoint is complete when its marker file exists. The marker is written last (atomically, after every rank has
finished its part of the save), so a directory without it is a torn write. Resuming "from the latest" takes the
newest checkpoint with a marker and says which newer directories it skipped; a torn directory is removed when the
run saves the same step again. Checkpoint rotation (``save_total_limit``) runs only after the marker exists, so the
previous complete checkpoint is never deleted before the new one is complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

from transformers.trainer_utils import rotate_checkpoints
from transformers.utils import logging

from ..atomic_files import write_text_atomically

logger = logging.get_logger(__name__)

CHECKPOINT_COMPLETE_MARKER = "trlx_scale_checkpoint_complete.json"
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


def is_complete_checkpoint(path: str) -> bool:
    """Whether ``path`` is a checkpoint whose save finished (its completion marker exists)."""
    return os.path.isfile(os.path.join(path, CHECKPOINT_COMPLETE_MARKER))


def checkpoint_dirs(output_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-N`` directory in ``output_dir``, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_DIR.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint in ``output_dir`` (None if there is none); newer torn ones are skipped with a
    warning."""
    skipped = []
    for _, path in reversed(checkpoint_dirs(output_dir)):
        if is_complete_checkpoint(path):
            if skipped:
                logger.warning(
                    "Resuming from %s: skipped %s, whose save did not finish (no %s).",
                    path,
                    ", ".join(skipped),
                    CHECKPOINT_COMPLETE_MARKER,
                )
            return path
        skipped.append(os.path.basename(path))
    if skipped:
        logger.warning("No complete checkpoint in %s: %s never finished saving.", output_dir, ", ".join(skipped))
    return None


def resolve_resume_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """``True``: the latest complete checkpoint (an error if there is none); a path: that checkpoint, refused if
    its save never finished; None/False: no resume."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        path = latest_complete_checkpoint(output_dir)
        if path is None:
            raise ValueError(
                f"resume_from_checkpoint=True found no complete checkpoint in output_dir={output_dir!r} (a complete "
                f"one holds {CHECKPOINT_COMPLETE_MARKER}). Start without resume_from_checkpoint, or pass the path of "
                "a checkpoint written by another tool explicitly."
            )
        return path
    path = str(resume_from_checkpoint)
    if not os.path.isdir(path):
        raise ValueError(f"resume_from_checkpoint={path!r} is not a directory: pass a checkpoint-N directory.")
    if not is_complete_checkpoint(path):
        if not os.path.isfile(os.path.join(path, "trainer_state.json")):
            raise ValueError(
                f"resume_from_checkpoint={path!r} is a torn checkpoint (its save never finished: no "
                "trainer_state.json, no completion marker). Resume from an older checkpoint-N, or use "
                "resume_from_checkpoint=True to take the latest complete one."
            )
        logger.warning("%s has no completion marker (saved by another tool?): resuming from it anyway.", path)
    return path


def mark_checkpoint_complete(path: str, global_step: int) -> None:
    """Write the completion marker (after every file of the checkpoint is on disk)."""
    write_text_atomically(
        os.path.join(path, CHECKPOINT_COMPLETE_MARKER),
        json.dumps({"global_step": global_step, "completed_at": time.time()}),
    )


class AtomicCheckpointMixin:
    """Mixed into a trainer: completion markers on save, torn checkpoints skipped on resume."""

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        resume_from_checkpoint = resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        run_dir = self._get_output_dir(trial=trial)
        path = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(path) and not is_complete_checkpoint(path):
            logger.warning("Removing %s: a torn checkpoint of an earlier run (its save never finished).", path)
            shutil.rmtree(path)
        self.accelerator.wait_for_everyone()
        # transformers rotates (deletes old checkpoints) at the end of its save, before the marker could exist: the
        # rotation is held back (on this trainer's own args, restored right after) and run once the marker is there.
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        if not self.args.save_only_model:
            self._save_extra_state(path)
        self.accelerator.wait_for_everyone()  # every rank's part of the checkpoint is written
        if self.args.should_save:
            mark_checkpoint_complete(path, self.state.global_step)
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def _save_extra_state(self, checkpoint_dir: str) -> None:
        """Seam: trainer state transformers does not save (GRPO's rollout buffer, PPO's critic), written on every
        rank before the completion marker."""

    def _load_extra_state(self, checkpoint_dir: str) -> None:
        """Seam: read back what ``_save_extra_state`` wrote, on every rank, when a run resumes."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:  # resuming (transformers calls this once the optimizer exists)
            self._load_extra_state(checkpoint)
