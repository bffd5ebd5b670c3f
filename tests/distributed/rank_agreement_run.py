"""2 gloo processes (torchrun): ``failing_together`` turns one rank's error into the same error on every rank, at
once, and costs nothing when no rank fails. Writes a JSON report (the last argument) from rank 0."""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import torch.distributed as dist

from trlx_scale.reliability.rank_agreement import RankFailureError, failing_together


def outcome(accelerator, rank_that_fails: int | None) -> dict:
    began = time.monotonic()
    try:
        with failing_together(accelerator, "the test block"):
            if dist.get_rank() == rank_that_fails:
                raise ConnectionError(f"rank {rank_that_fails}'s server answered 500")
            time.sleep(0.2 * dist.get_rank())  # ranks reach the end at different times
    except RankFailureError as error:
        return {"error": str(error), "failures": error.failures, "seconds": time.monotonic() - began}
    return {"error": None, "seconds": time.monotonic() - began}


def main() -> None:
    dist.init_process_group("gloo")
    accelerator = SimpleNamespace(num_processes=dist.get_world_size())
    mine = {str(case): outcome(accelerator, case) for case in (None, 0, 1)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        with open(sys.argv[-1], "w") as handle:
            json.dump(everyone, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
