"""A full-weight update's server side in a thread of its own, while the trainer goes on to its next step.

Why: a full-weight update through files has a part that needs the trainer (the weights merged and written, its
log-probs of the verification probe: its model, its collectives) and a part that only waits on the servers (pause,
reload from the files, prefix-cache reset, resume, the servers' log-probs of the probe, the comparison). Inline, the
trainer waits for the second part every rollout (about 0.1 s of a 0.5 s step on this project's 2-core machine; on a
GPU, seconds per reload of a large model). With ``max_staleness >= 1`` its next step trains on groups sampled by
older versions, so nothing in that step needs the new version to be served yet: only the producer does, to start the
groups the version admits, and it is told (``publish_version``) by the thread the moment the servers serve it.

The thread touches no model, tokenizer or collective: the trainer's thread prepares everything that does. The next
update (or an evaluation, a checkpoint, the run's end) waits for it first (``finish``), which raises its error; a
failure also fails the producer at once (``RolloutProducer.fail``), so a trainer waiting for groups learns of it in
seconds, never as a slow server.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class BackgroundDelivery:
    """One update's server side, running: ``version``, its thread, and what it returned or raised."""

    def __init__(self, version: int, deliver: Callable[[], Any], on_error: Callable[[BaseException], None]):
        self.version = version
        self._deliver = deliver
        self._on_error = on_error
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"trlx-scale-weight-delivery-{version}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._deliver()
        except BaseException as error:  # noqa: BLE001 - raised on the trainer's thread by finish()
            self._error = error
            self._on_error(error)

    @property
    def error(self) -> BaseException | None:
        """What the delivery raised (None while it runs well, or if it landed). Set before ``on_error`` is called,
        so a waiter that ``on_error`` wakes finds it."""
        return self._error

    def wait(self, timeout: float | None) -> bool:
        """Wait at most ``timeout`` seconds (None: until it ends); whether it has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def finish(self) -> Any:
        """Wait for the delivery; its return value, or its error raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result
