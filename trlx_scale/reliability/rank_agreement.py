"""One rank's failure becomes every rank's error, at once: no rank waits in a collective for a rank that has died.

In a multi-process run some work happens on one rank only (the main process talks to the generation servers) or
can fail on one rank only (its own producer, its own reward functions, its own timeouts). When it fails there, that
rank raises while the others go on to the next collective (a barrier, a ZeRO-3 gather, the gradients' all-reduce)
and wait in it until the collective's timeout: 10 to 30 minutes, with nothing in their logs, and a launcher that
may kill the job before the failing rank's traceback is flushed.

``failing_together(accelerator, what)`` closes such a block with one small collective: every rank reports whether the
block raised and with what, and if any rank did, every rank raises the same ``RankFailureError``, naming each
failing rank and its error (the failing rank chains its own exception). The block must end on every rank in bounded
time (its own timeouts do that), which is what the places that use it guarantee; the cost when nothing fails is one
``all_gather_object`` of ``None``, about a millisecond on gloo.

On one process the block's own exception is raised unchanged: there is nobody to tell.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class RankFailureError(RuntimeError):
    """Raised on every rank when a block of ``failing_together`` raised on any of them."""

    def __init__(self, message: str, failures: list[tuple[int, str]]):
        super().__init__(message)
        self.failures = failures  # (rank, "ErrorType: message") of every rank that failed


def _world(accelerator: Any) -> int:
    import torch.distributed as dist

    if accelerator is None or accelerator.num_processes == 1 or not dist.is_initialized():
        return 1
    return accelerator.num_processes


def raise_if_any_rank_failed(accelerator: Any, what: str, error: BaseException | None) -> None:
    """Every rank calls it at the same point with its own outcome (``None``: no error); raises everywhere if any rank
    failed (see the module docstring)."""
    world = _world(accelerator)
    if world == 1:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    mine = None if error is None else f"{type(error).__name__}: {error}"
    everyone: list[str | None] = [None] * world
    dist.all_gather_object(everyone, mine)
    failures = [(rank, message) for rank, message in enumerate(everyone) if message is not None]
    if not failures:
        return
    ranks = ", ".join(str(rank) for rank, _ in failures)
    details = "\n".join(f"rank {rank}: {message}" for rank, message in failures)
    raise RankFailureError(
        f"{what} failed on rank{'s' if len(failures) > 1 else ''} {ranks} of {world}; every rank stops here.\n"
        f"{details}",
        failures,
    ) from error


@contextlib.contextmanager
def failing_together(accelerator: Any, what: str) -> Iterator[None]:
    """Run the block on every rank; if it raises on any rank, raise ``RankFailureError`` on all of them (``what``
    names the block in the message: "sending policy version 3 to the servers")."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - reported to every rank, then raised
        raise_if_any_rank_failed(accelerator, what, error)
        raise  # unreachable: the call above raises
    raise_if_any_rank_failed(accelerator, what, None)
