"""A line every ``every`` seconds during a long wait that would otherwise print nothing (a vLLM server's start-up, a
checkpoint's checksums, the Hub upload's secret scan), so that a user's terminal shows the run is alive and where
it is.

    notice = PeriodicNotice("vLLM server start-up", every=10.0)
    while waiting:
        notice.tick(lambda elapsed: f"{elapsed:.0f} s; log: {newest_line()}")

The clock and the report are injectable: tests drive them without waiting."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger("trlx_scale.progress")

# Seconds between two lines: often enough to see progress, rarely enough not to flood a log over a 10-minute start-up.
PROGRESS_EVERY_SECONDS = 10.0


class PeriodicNotice:
    """Reports ``what: message`` at most once per ``every`` seconds, the first time ``every`` seconds after it was
    made (a wait that ends sooner prints nothing)."""

    def __init__(
        self,
        what: str,
        every: float = PROGRESS_EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        report: Callable[[str], None] | None = None,
    ):
        self.what, self.every, self._clock = what, every, clock
        self._report = report or (lambda line: logger.warning(line))
        self._start = self._last = clock()
        self.reported = 0

    def tick(self, message: Callable[[float], str]) -> None:
        """Report ``message(elapsed seconds)`` when ``every`` seconds have passed since the last report."""
        now = self._clock()
        if now - self._last >= self.every:
            self._last = now
            self.reported += 1
            self._report(f"{self.what}: {message(now - self._start)}")
