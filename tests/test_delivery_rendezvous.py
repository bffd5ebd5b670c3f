"""The store two ranks' background delivery threads agree through (generation/delivery_rendezvous.py), on a real
TCPStore in one process: rank 1 is a thread here, as it is a thread of its own process in a run."""

from __future__ import annotations

import threading

import pytest
from torch.distributed import TCPStore

from trlx_scale.generation.delivery_rendezvous import DeliveryRendezvous, RemoteDeliveryError


def _two_ranks(timeout: float) -> tuple[DeliveryRendezvous, DeliveryRendezvous]:
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    other = TCPStore("127.0.0.1", host.port, is_master=False)
    return DeliveryRendezvous(host, 0, 2, timeout), DeliveryRendezvous(other, 1, 2, timeout)


def _in_thread(call) -> dict:
    """Run ``call`` in a thread; the dict gets its error (or None) once it ends."""
    outcome: dict = {}

    def run():
        try:
            call()
            outcome["error"] = None
        except Exception as error:  # noqa: BLE001 - inspected by the test
            outcome["error"] = error

    outcome["thread"] = threading.Thread(target=run)
    outcome["thread"].start()
    return outcome


def test_every_rank_holds_then_learns_the_outcome_and_old_keys_go():
    main, other = _two_ranks(timeout=30)
    # Rank 1 as well, on the same store, with a wait too short to outlast a missing outcome.
    impatient = DeliveryRendezvous(other._store, 1, 2, 0.05)
    for version in (3, 5):  # not consecutive: weight_sync_steps=2
        waiting = _in_thread(lambda v=version: other.report_held(v, None))
        main.report_held(version, None)
        main.wait_until_every_rank_holds(version)
        waiting["thread"].join(10)
        assert waiting["error"] is None
        # Every rank holds, yet rank 1 is not released: it waits for the outcome, not only for its own answer.
        with pytest.raises(RemoteDeliveryError, match="announced no outcome"):
            impatient.wait_for_outcome(version)
        main.announce(version, None)
        other.wait_for_outcome(version)  # released by the announcement
    # Version 3's keys went when 5 was announced (both ranks had read them); version 5's stay until the next.
    assert not other._store.check([main._key(3, "outcome")]) and not other._store.check([main._key(3, "held/1")])
    assert other._store.check([main._key(5, "outcome")])


def test_a_rank_that_cannot_hold_and_a_failed_update_are_named_on_every_rank():
    main, other = _two_ranks(timeout=30)
    other.report_held(7, TimeoutError("requests still at the server after 300 s"))
    main.report_held(7, None)
    with pytest.raises(RemoteDeliveryError, match="rank 1 could not hold its requests.*TimeoutError: requests still"):
        main.wait_until_every_rank_holds(7)
    main.announce(7, ValueError("the vLLM server at http://x does not serve policy version 7"))
    with pytest.raises(RemoteDeliveryError, match="failed on the main process: ValueError: .*does not serve policy"):
        other.wait_for_outcome(7)


def test_a_silent_rank_is_a_bounded_wait_named_by_rank():
    main, other = _two_ranks(timeout=1)
    main.report_held(2, None)
    with pytest.raises(
        RemoteDeliveryError, match=r"no answer from rank 1 within 1 s \(whether it holds its requests\)"
    ):
        main.wait_until_every_rank_holds(2)
    with pytest.raises(RemoteDeliveryError, match="the main process announced no outcome within 3 s"):
        other.wait_for_outcome(2)
