"""Checkpoints that count only once complete.

transformers writes ``checkpoint-N/`` in place, file by file, and ``resume_from_checkpoint=True`` picks the newest
directory: a process killed mid-save leaves a torn checkpoint that the next run resumes from (or crashes on). Here a
checkpoint is complete when its marker file exists. The marker is written last (atomically, after every rank has
finished its part of the save), so a directory without it is a torn write. Resuming "from the latest" takes the
newest checkpoint with a marker and says which newer directories it skipped; a torn directory is removed when the
run saves the same step again. Checkpoint rotation (``save_total_limit``) runs only after the marker exists, so the
previous complete checkpoint is never deleted before the new one is complete.

The marker also records each file's size and checksum (``checkpoint_integrity.py``): resuming verifies them, a damaged
checkpoint named explicitly is refused with the file, and "the latest" falls back to the previous good one with a
warning. Before a save the disk's free space is checked against the save's size, and an out-of-space error during
one names the directory and the bytes (``disk_space.py``). A preemption signal finishes the step, saves it and exits
with a code of its own (``preemption.py``).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from collections.abc import Callable

from transformers import TrainerCallback
from transformers.trainer_utils import rotate_checkpoints
from transformers.utils import logging

from ..atomic_files import write_text_atomically
from ..trainer_part import TrainerPart
from .checkpoint_integrity import ALGORITHM, Gather, checksum_files, damaged_files
from .deepspeed_reshard import convert_to_universal, saved_world_size
from .disk_space import (
    CheckpointDiskSpaceError,
    disk_space_message,
    is_out_of_space,
    space_shortfall,
)
from .preemption import PreemptionCallback, PreemptionHandler, TrainingPreempted, write_main_pid
from .sharded_checkpoint import PendingShardedSave, save_sharded, uses_sharded_fsdp_checkpoints

logger = logging.get_logger(__name__)

CHECKPOINT_COMPLETE_MARKER = "trlx_scale_checkpoint_complete.json"
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
# A checkpoint's problems: one line per damaged file (empty: intact). Default: checked by this process alone.
Verifier = Callable[[str], list[str]]


class UnreadableMarkerError(ValueError):
    """The completion marker exists but cannot be read (damaged itself)."""


def read_marker(path: str) -> dict:
    try:
        with open(os.path.join(path, CHECKPOINT_COMPLETE_MARKER)) as handle:
            marker = json.load(handle)
    except (OSError, ValueError) as error:
        raise UnreadableMarkerError(f"its {CHECKPOINT_COMPLETE_MARKER} is unreadable ({error})") from error
    if not isinstance(marker, dict):
        raise UnreadableMarkerError(f"its {CHECKPOINT_COMPLETE_MARKER} is not a JSON object")
    return marker


def verify_checkpoint(path: str, rank: int = 0, world_size: int = 1, gather: Gather | None = None) -> list[str]:
    """The damaged files of a complete checkpoint against the checksums of its marker (empty: intact). A marker of
    an older trlx_scale has no checksums: nothing to verify, a warning says so."""
    try:
        recorded = read_marker(path).get("files")
    except UnreadableMarkerError as error:
        return [str(error)]
    if recorded is None:
        logger.warning("%s records no checksums (saved by an older trlx_scale): resuming from it unverified.", path)
        return []
    return damaged_files(path, recorded, rank, world_size, gather or (lambda items: items))


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


def latest_complete_checkpoint(output_dir: str, verify: Verifier | None = None) -> str | None:
    """The newest complete checkpoint in ``output_dir`` (None if there is none); newer torn ones are skipped with a
    warning, and so are damaged ones when ``verify`` is given (each named with its damaged files)."""
    skipped = []
    for _, path in reversed(checkpoint_dirs(output_dir)):
        if not is_complete_checkpoint(path):
            skipped.append(f"{os.path.basename(path)} (its save did not finish: no {CHECKPOINT_COMPLETE_MARKER})")
            continue
        problems = verify(path) if verify is not None else []
        if problems:
            skipped.append(f"{os.path.basename(path)} (damaged: {'; '.join(problems)})")
            continue
        if skipped:
            logger.warning("Resuming from %s: skipped %s.", path, ", ".join(skipped))
        return path
    if skipped:
        logger.warning("No usable checkpoint in %s: %s.", output_dir, ", ".join(skipped))
    return None


def resolve_resume_checkpoint(
    resume_from_checkpoint: str | bool | None, output_dir: str, verify: Verifier | None = verify_checkpoint
) -> str | None:
    """``True``: the latest complete, intact checkpoint (an error if there is none); a path: that checkpoint,
    refused if its save never finished or a file of it is damaged; None/False: no resume. ``verify``: the checksum
    check (None skips it)."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        path = latest_complete_checkpoint(output_dir, verify)
        if path is None:
            raise ValueError(
                f"resume_from_checkpoint=True found no complete, intact checkpoint in output_dir={output_dir!r} (a "
                f"complete one holds {CHECKPOINT_COMPLETE_MARKER}; the warning above names what was skipped). Start "
                "without resume_from_checkpoint, or pass the path of a checkpoint written by another tool explicitly."
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
    problems = verify(path) if verify is not None else []
    if problems:
        raise ValueError(
            f"resume_from_checkpoint={path!r} is damaged: {'; '.join(problems)}. Resume from an older checkpoint-N, "
            "or use resume_from_checkpoint=True to take the latest intact one (or set verify_checkpoints=False to "
            "load it anyway)."
        )
    return path


def mark_checkpoint_complete(
    path: str, global_step: int, files: dict[str, dict] | None = None, world_size: int | None = None
) -> None:
    """Write the completion marker (after every file of the checkpoint is on disk), with each file's size and
    checksum when ``files`` is given (``checkpoint_integrity.checksum_files``) and the number of processes that
    saved it."""
    marker: dict = {"global_step": global_step, "completed_at": time.time()}
    if world_size is not None:
        marker["world_size"] = world_size
    if files is not None:
        marker.update(algorithm=ALGORITHM, files=files)
    write_text_atomically(os.path.join(path, CHECKPOINT_COMPLETE_MARKER), json.dumps(marker, indent=1))


def checkpoint_world_size(path: str) -> int | None:
    """How many processes saved a complete checkpoint (None: not recorded, or no marker)."""
    try:
        return read_marker(path).get("world_size") if is_complete_checkpoint(path) else None
    except UnreadableMarkerError:
        return None


def checkpoint_bytes(path: str) -> int | None:
    """The size of a complete checkpoint from its marker (None when the marker records no files)."""
    try:
        files = read_marker(path).get("files")
        return None if files is None else sum(int(entry["bytes"]) for entry in files.values())
    except (UnreadableMarkerError, AttributeError, KeyError, TypeError, ValueError):
        return None


class _FinishPendingSaves(TrainerCallback):
    """Each step's end: mark the asynchronous saves that every rank has finished writing."""

    def __init__(self, checkpoints: AtomicCheckpoints):
        self.checkpoints = checkpoints

    def on_step_end(self, args, state, control, **kwargs):
        self.checkpoints.finish_pending_saves(block=False)


class AtomicCheckpoints(TrainerPart):
    """The trainer's checkpoints (``trlx_scale.trainer_features`` builds it and delegates transformers' save, load
    and train to it): completion markers with checksums on save, torn and damaged checkpoints skipped on
    resume, the disk's free space checked before each save, preemption signals, asynchronous sharded saves. Reads
    ``verify_checkpoints``, ``save_on_preemption`` and ``async_checkpoints`` from the config."""

    # Asynchronous sharded saves: the one being written by this _save_checkpoint call (set in
    # _save_optimizer_and_scheduler, which transformers calls from inside it), and those written but not yet marked
    # complete: (path, step, pending writes, run_dir, save_total_limit), oldest first.
    _writing: PendingShardedSave | None = None
    _unmarked: tuple = ()
    _last_completed: str | None = None  # the newest checkpoint this run completed

    def _verify_checkpoints(self) -> bool:
        if not self.trainer.args.verify_checkpoints:
            return False
        if self.trainer.args.save_on_each_node:
            # Each node holds its own copy: the ranks' shares of the file list would name files of other nodes.
            logger.warning_once("save_on_each_node=True: checkpoint checksums are neither recorded nor verified.")
            return False
        return True

    def _gather(self, items: list) -> list:
        from accelerate.utils import gather_object

        return gather_object(items) if self.trainer.accelerator.num_processes > 1 else items

    def _verify_on_every_rank(self, path: str) -> list[str]:
        """The checksum check, split across ranks; every rank gets the same answer."""
        return verify_checkpoint(
            path, self.trainer.accelerator.process_index, self.trainer.accelerator.num_processes, self._gather
        )

    def run_training(self, base_train: Callable, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """transformers' ``train`` (``base_train``) on a verified checkpoint, with preemption and pending saves."""
        verify = self._verify_on_every_rank if self._verify_checkpoints() else None
        resume_from_checkpoint = resolve_resume_checkpoint(
            resume_from_checkpoint, self.trainer.args.output_dir, verify
        )
        if resume_from_checkpoint is not None and self.trainer.is_deepspeed_enabled:
            self._reshard_deepspeed_checkpoint(resume_from_checkpoint)
        handler = PreemptionHandler()
        callback = PreemptionCallback(handler, self.any_rank)
        self._preemption = callback
        pid_file = None
        if self.trainer.args.save_on_preemption and handler.install():
            self.trainer.add_callback(callback)
            if self.trainer.is_world_process_zero():
                pid_file = write_main_pid(self.trainer.args.output_dir)
        pending_saves = _FinishPendingSaves(self)
        self.trainer.add_callback(pending_saves)
        try:
            result = base_train(resume_from_checkpoint, *args, **kwargs)
            self.finish_pending_saves(block=True)  # the last asynchronous save is durable and marked
        finally:
            handler.uninstall()
            self.trainer.remove_callback(callback)
            self.trainer.remove_callback(pending_saves)
            if pid_file is not None and os.path.exists(pid_file):
                os.remove(pid_file)
        if callback.preempted_at is None:
            handler.reraise_unhandled()  # a signal after the last step: honoured now that training is over
        elif self.trainer.state.global_step >= self.trainer.state.max_steps:
            logger.warning("A preemption signal came at the last step: training is complete and saved.")
        else:
            step = callback.preempted_at
            error = TrainingPreempted(
                step, os.path.join(self.trainer.args.output_dir, f"checkpoint-{step}"), handler.signal_name
            )
            logger.warning("%s", error)
            raise error
        return result

    def _reshard_deepspeed_checkpoint(self, checkpoint: str) -> None:
        """A DeepSpeed checkpoint saved by another number of processes loads through its universal copy."""
        saved, now = saved_world_size(checkpoint), self.trainer.accelerator.num_processes
        if saved is None or saved == now:
            return
        logger.warning(
            "%s was saved by %d processes and this run has %d: loading it through DeepSpeed's universal checkpoint "
            "(converted once, beside the original).",
            checkpoint,
            saved,
            now,
        )
        if os.path.isdir(os.path.join(checkpoint, "critic_deepspeed")):
            raise ValueError(
                f"{checkpoint} holds PPO's separate critic as a DeepSpeed engine of its own, which trlx_scale does not "
                f"convert to another world size yet: resume it with {saved} processes (it was saved by {saved})."
            )
        if self.trainer.accelerator.is_main_process:
            convert_to_universal(checkpoint)
        self.trainer.accelerator.wait_for_everyone()
        # The engine is built in train() (accelerator.prepare), from this dict: it reads the universal copy.
        self.trainer.accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})[
            "load_universal"
        ] = True

    def any_rank(self, flag: bool) -> bool:
        """``flag`` OR-ed over every rank (one MAX all-reduce; every rank calls it at the same step)."""
        import torch
        import torch.distributed as dist

        if self.trainer.accelerator.num_processes == 1 or not dist.is_initialized():
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.trainer.accelerator.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)

    def _expected_checkpoint_bytes(self, run_dir: str) -> tuple[int, str]:
        """What the next save writes: the previous complete checkpoint's size, else the model and optimizer states
        this rank holds (what transformers saves: trained weights, or all weights, and the optimizer's tensors)."""
        for _, path in reversed(checkpoint_dirs(run_dir)):
            if is_complete_checkpoint(path) and (size := checkpoint_bytes(path)) is not None:
                return size, f"the size of {os.path.basename(path)}"
        import torch

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        peft = hasattr(model, "peft_config")
        weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not peft)
        optimizer = 0
        if self.trainer.optimizer is not None:
            for state in self.trainer.optimizer.state.values():
                optimizer += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
        return weights + optimizer, "the model's saved weights and the optimizer's state, estimated"

    def _check_disk_space(self, path: str, run_dir: str) -> None:
        needed, basis = self._expected_checkpoint_bytes(run_dir)
        shortfall = space_shortfall(path, needed, self.trainer._free_disk_bytes(path), basis)
        shortfalls = self._gather([shortfall] if shortfall else [])  # every rank stops, or none does
        if shortfalls:
            raise CheckpointDiskSpaceError(errno.ENOSPC, shortfalls[0])

    def _async_sharded_saves(self) -> bool:
        return self.trainer.args.async_checkpoints and uses_sharded_fsdp_checkpoints(self.trainer)

    def save_optimizer_and_scheduler(self, base_save: Callable[[str], None], output_dir: str) -> None:
        if not self._async_sharded_saves():
            base_save(output_dir)
            return
        # The model's and optimizer's shards in Accelerate's SHARDED_STATE_DICT layout (transformers' resume reads
        # them), written in the background; the scheduler is small and saved now, as transformers does.
        self._writing = save_sharded(
            self.trainer.model, self.trainer.optimizer, output_dir, asynchronous=True, adapter_only=True
        )
        if self.trainer.args.should_save:
            import torch

            torch.save(self.trainer.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def finish_pending_saves(self, block: bool) -> None:
        """Mark (checksums, marker, rotation) the asynchronous saves whose shards every rank has written; ``block``
        waits for them. Every rank calls it at the same points (step ends, the next save, the end of train())."""
        while self._unmarked:
            path, step, pending, run_dir, limit = self._unmarked[0]
            if block:
                pending.wait()
            elif self.any_rank(not pending.done()):
                return  # some rank is still writing: try again at the next step's end
            pending.wait()  # re-raises a failed write on this rank
            self._unmarked = self._unmarked[1:]
            self._mark_complete(path, step, run_dir, limit)
            logger.info(
                "Asynchronous checkpoint %s is durable on every rank (%.1f s).",
                path,
                time.perf_counter() - pending.started,
            )

    def _mark_complete(self, path: str, step: int, run_dir: str, limit: int | None) -> None:
        files = None
        if self._verify_checkpoints():
            files = checksum_files(
                path, self.trainer.accelerator.process_index, self.trainer.accelerator.num_processes, self._gather
            )
        if self.trainer.args.should_save:
            mark_checkpoint_complete(path, step, files, self.trainer.accelerator.num_processes)
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=limit,
                best_model_checkpoint=self.trainer.state.best_model_checkpoint,
                use_mtime=True,
            )
        # No rank goes on (and, when preempted, exits) before the marker exists: a launcher that kills the whole job
        # when one process exits (srun --kill-on-bad-exit) must never cut rank 0 off before it.
        self.trainer.accelerator.wait_for_everyone()
        self._last_completed = path
        self.trainer._on_checkpoint_complete(path)

    def save_checkpoint(self, base_save: Callable, model, trial) -> None:
        """transformers' ``_save_checkpoint`` (``base_save``), then every checkpoint part, then the marker."""
        self.finish_pending_saves(block=True)  # one background save at a time: the previous one lands first
        run_dir = self.trainer._get_output_dir(trial=trial)
        path = os.path.join(run_dir, f"checkpoint-{self.trainer.state.global_step}")
        if self._last_completed == path and is_complete_checkpoint(path):
            return  # this run saved this very step already (e.g. the epoch's end right after a preemption's save)
        if self.trainer.args.should_save and os.path.isdir(path):
            # A torn one, or a complete one an earlier run wrote at this step (this run resumed from an older one):
            # writing into it would mix files of two runs (and of two world sizes) under a stale marker.
            why = (
                "an earlier run's"
                if is_complete_checkpoint(path)
                else "a torn checkpoint of an earlier run (its save never finished)"
            )
            logger.warning("Removing %s: %s.", path, why)
            shutil.rmtree(path)
        self.trainer.accelerator.wait_for_everyone()
        self._check_disk_space(path, run_dir)
        # transformers rotates (deletes old checkpoints) at the end of its save, before the marker could exist: the
        # rotation is held back (on this trainer's own args, restored right after) and run once the marker is there.
        limit, self.trainer.args.save_total_limit = self.trainer.args.save_total_limit, None
        try:
            base_save(model, trial)
            if not self.trainer.args.save_only_model:
                self.trainer.checkpoint_parts.save(path)
        except Exception as error:
            if not is_out_of_space(error):
                raise
            needed, basis = self._expected_checkpoint_bytes(run_dir)
            message = disk_space_message(path, needed, self.trainer._free_disk_bytes(path), basis, during=True)
            raise CheckpointDiskSpaceError(errno.ENOSPC, f"{message} (the writer said: {error})") from error
        finally:
            self.trainer.args.save_total_limit = limit
        self.trainer.accelerator.wait_for_everyone()  # every rank's part of the checkpoint is written (or, async, staged)
        writing, self._writing = self._writing, None
        if writing is not None:  # marked once every rank's shards are durable (_finish_pending_saves)
            self._unmarked = (*self._unmarked, (path, self.trainer.state.global_step, writing, run_dir, limit))
            return
        self._mark_complete(path, self.trainer.state.global_step, run_dir, limit)

    def seconds_since_preemption(self) -> float | None:
        """Seconds since every rank agreed to stop on a preemption signal (the save now is the preemption's);
        None outside a preemption."""
        callback = getattr(self, "_preemption", None)
        if callback is None or callback.decided_at is None:
            return None
        return callback.handler.clock() - callback.decided_at

    def after_optimizer_loaded(self, checkpoint: str | None) -> None:
        """After transformers' ``_load_optimizer_and_scheduler``: the DeepSpeed universal copy off again, and, when
        resuming, every checkpoint part loaded."""
        engine_config = (
            getattr(self.trainer.model_wrapped, "_config", None) if self.trainer.is_deepspeed_enabled else None
        )
        if getattr(engine_config, "load_universal_checkpoint", False):
            # The universal copy served this resume only: a later load (the best model at the end) reads the
            # engine's own checkpoints, which have no universal copy.
            engine_config.load_universal_checkpoint = False
        if checkpoint is not None:  # resuming (transformers calls this once the optimizer exists)
            self.trainer.checkpoint_parts.load(checkpoint)  # every part a component registered (checkpoint_parts)
