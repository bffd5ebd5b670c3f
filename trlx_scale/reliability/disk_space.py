"""Saving a checkpoint onto a full disk: refused before it starts, and named when it happens anyway.

Without this a full disk ends a run in ``RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos``
(torch's zip writer), which names neither the disk nor the directory. Before each save the free space of the
checkpoint's filesystem is compared with what the save will write (the previous complete checkpoint's size, from
its marker, else an estimate from the model and optimizer states); during a save an out-of-space error (``ENOSPC``,
``EDQUOT``, or torch's writer failing) becomes the same ``CheckpointDiskSpaceError``. The previous complete
checkpoint is untouched in both cases (the torn directory has no completion marker), so the run resumes from it once
there is room.
"""

from __future__ import annotations

import errno
import os

# Writing a checkpoint also writes temporary files and metadata beside the tensors: ask for a little more.
SAFETY_FACTOR = 1.05
# Messages with which torch's and safetensors' writers report a failed write (no errno survives in them).
_WRITER_FAILURES = ("PytorchStreamWriter failed", "unexpected pos", "file write failed", "No space left on device")


class CheckpointDiskSpaceError(OSError):
    """The disk holding a checkpoint has (or had) too little space for it."""


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB"


def existing_ancestor(path: str) -> str:
    """``path`` or the nearest directory above it that exists (the checkpoint directory may not yet)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def disk_space_message(directory: str, needed: int, free: int, basis: str, during: bool = False) -> str:
    start = (
        f"The disk ran out of space while saving {directory}"
        if during
        else f"Not enough disk space to save {directory}"
    )
    return (
        f"{start}: {_gib(free)} ({free} bytes) free, the checkpoint needs about {_gib(needed)} ({needed} bytes; "
        f"{basis}). Free space (older checkpoints: lower save_total_limit), or point output_dir at a larger disk. "
        "The previous complete checkpoint is intact: resume with resume_from_checkpoint=True once there is room."
    )


def space_shortfall(directory: str, needed: int, free: int, basis: str) -> str | None:
    """The error message when ``free`` bytes cannot hold ``needed`` (with the safety margin), else None."""
    if free >= needed * SAFETY_FACTOR:
        return None
    return disk_space_message(directory, needed, free, basis)


def is_out_of_space(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a write that failed for lack of space."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(error, RuntimeError) and any(text in str(error) for text in _WRITER_FAILURES):
            return True
        error = error.__cause__ or error.__context__
    return False
