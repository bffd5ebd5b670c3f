"""Shared ending of the torchrun test scripts: rank 0 writes the JSON report, every rank leaves the group."""

import gc
import json

import torch.distributed as dist


def finish(report: dict, report_path: str) -> None:
    """Write the report, then leave the group only once every rank is done with its collectives.

    Without the collection and the barrier, a rank could tear gloo down while the other still had work in flight with
    it, or free a sharded model's pending work after the group was gone: gloo then aborts with "terminate called
    without an active exception" (seen once in CI on the FSDP2 gather test)."""
    gc.collect()
    if dist.get_rank() == 0:
        with open(report_path, "w") as handle:
            json.dump(report, handle)
    dist.barrier()
    dist.destroy_process_group()
