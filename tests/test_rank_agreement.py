"""``reliability.rank_agreement``: one rank's failure is every rank's error (2 gloo processes), and on one process the
block's own error is raised unchanged."""

from __future__ import annotations

import pytest

from trlx_scale.reliability.rank_agreement import failing_together

from .helpers.launch import run_torchrun_report


def test_on_one_process_the_blocks_own_error_is_raised():
    with pytest.raises(ConnectionError, match="gone"):
        with failing_together(None, "the block"):
            raise ConnectionError("gone")
    with failing_together(None, "the block"):
        pass


@pytest.mark.distributed
def test_a_failure_on_either_rank_is_the_same_error_on_both(tmp_path):
    """Rank 0 fails (as the main process's send to a server does), then rank 1 (as its own producer does): both
    ranks raise a RankFailureError with the same message naming the failing rank and its error, in well under a
    second; without a failure neither raises."""
    ranks = run_torchrun_report("rank_agreement_run.py", tmp_path / "agreement.json", port=29681)
    for case in ("0", "1"):
        messages = {rank[case]["error"] for rank in ranks}
        assert len(messages) == 1, messages
        (message,) = messages
        assert message.startswith(f"the test block failed on rank {case} of 2; every rank stops here.")
        assert f"rank {case}: ConnectionError: rank {case}'s server answered 500" in message
        assert all(
            rank[case]["failures"] == [[int(case), f"ConnectionError: rank {case}'s server answered 500"]]
            for rank in ranks
        )
        assert all(rank[case]["seconds"] < 5 for rank in ranks)
    assert all(rank["None"]["error"] is None for rank in ranks)
