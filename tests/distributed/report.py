"""Shared ending of the torchrun / accelerate-launched test scripts: every rank leaves the process group only once
all ranks are done with their collectives (``leave_group``); ``finish`` writes rank 0's JSON report first."""

import gc
import json

import torch.distributed as dist


def leave_group() -> None:
    """Free what still holds collectives, wait for every rank, then destroy the process group.

    Without this, a rank could tear gloo down at interpreter exit while the other still had work in flight with it, or
    free a sharded model's (or a trainer's) pending work after the group was gone: gloo then aborts with "terminate
    called without an active exception" (seen in CI on the FSDP2 gather test, then on the reward-error test). Call it
    after the script's main() has returned, so its models and trainers are already unreferenced."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def finish(report: dict, report_path: str) -> None:
    """Rank 0 writes the report, then every rank leaves the group (``leave_group``)."""
    gc.collect()
    if dist.get_rank() == 0:
        with open(report_path, "w") as handle:
            json.dump(report, handle)
    leave_group()
