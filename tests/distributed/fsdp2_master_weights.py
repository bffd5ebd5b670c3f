"""Run under torchrun (2 processes, gloo, CPU): FSDP2 with trlx_scale's mixed-precision policy keeps fp32 sharded
masters, computes in bf16, and applies RL-sized updates that bf16 weights would lose. Writes a JSON report."""

import sys

import torch
import torch.distributed as dist
from report import finish  # tests/distributed/report.py (the script's folder)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from trlx_scale.optim.distributed_precision import fsdp2_mixed_precision_policy


def main() -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    with torch.no_grad():
        for layer in model:
            layer.weight.copy_(1.0 + 0.25 * torch.rand_like(layer.weight))
    initial = [layer.weight.detach().clone() for layer in model]
    policy = fsdp2_mixed_precision_policy()
    for layer in model:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    sharded = [layer.weight for layer in model]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.95), weight_decay=0.0)
    output_dtypes = set()
    for step in range(50):
        generator = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.rand(8, 64, generator=generator)  # positive inputs: the gradient keeps its sign
        output = model(x)
        output_dtypes.add(str(output.dtype))
        (-output.float().sum()).backward()  # pushes every weight in a consistent direction
        optimizer.step()
        optimizer.zero_grad()
    full = [p.full_tensor() for p in sharded]
    report = {
        "sharded_dtypes": sorted({str(p.dtype) for p in sharded}),
        "is_dtensor": all(isinstance(p, DTensor) for p in sharded),
        "local_rows": [p.to_local().shape[0] for p in sharded],
        "output_dtypes": sorted(output_dtypes),
        "mean_master_change": sum((f - i).abs().mean().item() for f, i in zip(full, initial, strict=True)) / len(full),
        "fraction_master_changed": sum((f != i).float().mean().item() for f, i in zip(full, initial, strict=True))
        / len(full),
        "fraction_bf16_changed": sum(
            (f.to(torch.bfloat16) != i.to(torch.bfloat16)).float().mean().item()
            for f, i in zip(full, initial, strict=True)
        )
        / len(full),
    }
    return report


if __name__ == "__main__":
    # main() returns first, so the sharded model and its pending collectives are freed while the group is alive.
    finish(main(), sys.argv[1])
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
