"""The gate between the producer's requests to the generation servers and the trainer's full-weight reloads.

A server reloads full weights in place, so a request's policy version is the one its client knew when sending it.
The trainer therefore reloads inside ``hold`` (its thread): no new request goes out, and the hold begins once every
request already at a server has come back. Requests pass ``request`` (the producer's event loop), which waits while a
hold is on and counts the request until its answer is in.

What is counted is one HTTP request, not a whole group: a multi-turn trajectory waiting on its tool holds no request
at the server, so a reload does not wait for tools (it waited for whole groups, tools included, before: the async
tools benchmark ran at 0.94x the synchronous loop). The trajectory's next turn, sent after the reload, is sampled by
the new weights and carries that version (``VLLMServerClient.sample_turn``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator


class RequestGate:
    """See the module docstring. Thread-safe: ``hold`` from any thread, ``request`` from one event loop."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._open = 0  # requests at a server now
        self._held = 0  # hold() callers inside their block (or waiting to enter it)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._released: asyncio.Event | None = None  # set on the loop when the last hold ends

    @property
    def held(self) -> bool:
        with self._lock:
            return self._held > 0

    @property
    def open_requests(self) -> int:
        with self._lock:
            return self._open

    @contextlib.contextmanager
    def hold(self, timeout: float, give_up: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """No new request inside the block, which starts once the requests at a server have returned. Raises
        ``TimeoutError`` if they have not within ``timeout`` seconds; ``give_up()`` true (the producer failed: its
        requests will not return) enters the block at once."""
        with self._lock:
            self._held += 1
            deadline = time.monotonic() + timeout
            while self._open > 0 and not give_up():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    open_now = self._open
                    self._release_locked()
                    raise TimeoutError(f"{open_now} requests still at the server after {timeout:.0f} s.")
                self._lock.wait(min(remaining, 1.0))
        try:
            yield
        finally:
            with self._lock:
                self._release_locked()

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        """One request to a server: entered when no hold is on, counted until the block ends. Whatever the block
        reads of the servers' state (the version they serve) cannot change before it ends."""
        while True:
            with self._lock:
                if self._held == 0:
                    self._open += 1
                    break
                if self._released is None or self._loop is not asyncio.get_running_loop():
                    self._loop, self._released = asyncio.get_running_loop(), asyncio.Event()
                # Cleared under the lock: a release after this schedules a set() that runs after the clear.
                self._released.clear()
                released = self._released
            await released.wait()
        try:
            yield
        finally:
            with self._lock:
                self._open -= 1
                self._lock.notify_all()

    def _release_locked(self) -> None:
        self._held -= 1
        if self._held == 0 and self._released is not None and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._released.set)
            except RuntimeError:  # the loop closed in between: nobody waits on it
                pass
