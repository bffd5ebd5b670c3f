"""Every rank's part of a background full-weight update, agreed through a key-value store, not a collective.

Why: with several training processes a full-weight reload needs every rank's producer to hold its requests around
it (``full_weight_reload="drain"``; on vLLM's CPU build also around the probe, which must run alone), and every
rank to know that the version is served before its producer asks for it. Inline, that agreement is a collective on
the trainer's thread. A background delivery runs in a thread of each rank while the trainer's thread goes on with
the training's own collectives, and collectives on one process group must be issued in the same order on every
rank: a thread cannot join them. The threads meet through a ``TCPStore`` the main process hosts instead (the same
kind of store ``torch.distributed`` starts its process group with, on a port of its own):

1. each rank's thread holds its producer's requests, then writes that it holds (or why it could not);
2. the main process's thread waits for every rank's answer, reloads the servers and checks the probe;
3. it writes the outcome (served, or the error), which every other rank's thread waits for; each then records the
   version, lets its requests go and publishes the version to its producer, or fails its producer with the error.

Every wait is bounded (``timeout``); a rank that could not hold, or an update that failed, is an error named on every
rank, never a thread left waiting. Waiting on the store releases the GIL: the trainer's thread trains meanwhile.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

from torch.distributed import DistStoreError, TCPStore

from ..reliability.rank_agreement import failing_together


class RemoteDeliveryError(RuntimeError):
    """A background full-weight update failed on another rank (its error, by name)."""


def _describe(error: BaseException | None) -> str:
    return "" if error is None else f"{type(error).__name__}: {error}"


class DeliveryRendezvous:
    """The store the delivery threads of ``world`` ranks meet in (see the module docstring)."""

    def __init__(self, store: TCPStore, rank: int, world: int, timeout: float):
        self._store = store
        self.rank = rank
        self.world = world
        self.timeout = datetime.timedelta(seconds=timeout)
        self._previous: int | None = None  # the main process: the last version announced

    @classmethod
    def create(cls, accelerator: Any, timeout: float) -> DeliveryRendezvous | None:
        """Every rank calls it at the same point (a broadcast tells the others the store's port; a store that
        cannot start or be reached is the same error on every rank); None with one process. ``timeout``: the
        longest one stage may take (a rank's hold, the reload, the probe)."""
        if accelerator.num_processes == 1:
            return None
        from accelerate.utils import broadcast_object_list

        # MASTER_ADDR is the main process's host, which every rank of the launch reaches (torch's own store is there).
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        span = datetime.timedelta(seconds=timeout)
        store, port, failure = None, None, None
        if accelerator.is_main_process:
            try:
                store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=span)
                port = store.port
            except Exception as error:  # noqa: BLE001 - raised on every rank below
                failure = error
        port = broadcast_object_list([port])[0]  # None: the main process could not start it
        with failing_together(accelerator, "starting the store the weight-delivery threads agree through"):
            if failure is not None:
                raise failure
            if port is None:
                raise RemoteDeliveryError(f"the main process could not start its store at {host}.")
            if store is None:
                store = TCPStore(host, port, is_master=False, timeout=span)
        return cls(store, accelerator.process_index, accelerator.num_processes, timeout)

    def _key(self, version: int, what: str) -> str:
        return f"trlx_scale/weights/{version}/{what}"

    def report_held(self, version: int, error: BaseException | None) -> None:
        """This rank's producer holds its requests for ``version``'s reload (``error``: why it could not)."""
        self._store.set(self._key(version, f"held/{self.rank}"), _describe(error))

    def wait_until_every_rank_holds(self, version: int) -> None:
        """The main process: every rank's answer; raises naming the ranks that could not hold."""
        keys = [self._key(version, f"held/{rank}") for rank in range(self.world)]
        try:
            self._store.wait(keys, self.timeout)
        except DistStoreError:
            silent = [rank for rank, key in enumerate(keys) if not self._store.check([key])]
            raise RemoteDeliveryError(
                f"policy version {version}'s reload: no answer from rank{'s' if len(silent) > 1 else ''} "
                f"{', '.join(map(str, silent))} within {self.timeout.total_seconds():.0f} s (whether it holds its "
                "requests)."
            ) from None
        failures = [(rank, self._store.get(key).decode()) for rank, key in enumerate(keys)]
        failures = [(rank, message) for rank, message in failures if message]
        if failures:
            raise RemoteDeliveryError(
                f"policy version {version}'s reload: "
                + "; ".join(f"rank {rank} could not hold its requests ({message})" for rank, message in failures)
            )

    def announce(self, version: int, error: BaseException | None) -> None:
        """The main process: ``version`` is served and verified, or its update failed with ``error``."""
        self._store.set(self._key(version, "outcome"), _describe(error))
        # Every rank read the previous update's outcome before it answered for this one (a rank's next update waits
        # for its last): its keys can go.
        if self._previous is not None:
            for what in ["outcome", *(f"held/{rank}" for rank in range(self.world))]:
                self._store.delete_key(self._key(self._previous, what))
        self._previous = version

    def wait_for_outcome(self, version: int) -> None:
        """Another rank: wait for the main process's outcome of ``version``; raises the failure it announced. The
        main process answers after the slowest rank's hold, the reload and the probe: up to three waits."""
        key = self._key(version, "outcome")
        try:
            self._store.wait([key], 3 * self.timeout)
        except DistStoreError:
            raise RemoteDeliveryError(
                f"policy version {version}'s update: the main process announced no outcome within "
                f"{3 * self.timeout.total_seconds():.0f} s."
            ) from None
        message = self._store.get(key).decode()
        if message:
            raise RemoteDeliveryError(f"policy version {version}'s update failed on the main process: {message}")

    def close(self) -> None:
        self._store = None
