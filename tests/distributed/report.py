"""Shared ending of the torchrun test scripts: rank 0 writes the JSON report, every rank leaves the group."""

import json

import torch.distributed as dist


def finish(report: dict, report_path: str) -> None:
    if dist.get_rank() == 0:
        with open(report_path, "w") as handle:
            json.dump(report, handle)
    dist.destroy_process_group()
