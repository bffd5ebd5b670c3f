"""Blocking time per training checkpoint under FSDP2: consolidated on rank 0 vs per-rank shards, synchronous vs
asynchronous.

Run by torchrun (gloo, CPU, raw ``fully_shard`` as Accelerate wraps: each decoder layer, then the root). The model
is built from its config (random weights) in fp32 with an AdamW state (one step), so a checkpoint holds weights plus
two moments: 12 bytes per parameter. Per save, median of ``--repeats``:

- ``consolidated``: what ``fsdp_state_dict_type: FULL_STATE_DICT`` does (Accelerate's ``save_fsdp_model`` /
  ``save_fsdp_optimizer``): the full model and optimizer state gathered to rank 0's host memory, rank 0 writes them,
  every rank waits;
- ``sharded``: ``trlx_scale.reliability.sharded_checkpoint.save_sharded`` (each rank writes its DCP shards);
- ``async``: the same with ``asynchronous=True``: the blocking part is staging the shards into host memory; the
  write's total time (until durable) is reported beside it.

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/sharded_checkpoint.py --model llama_30m --repeats 5
    python -m torch.distributed.run --nproc_per_node 2 benchmarks/sharded_checkpoint.py --model qwen2_05b --repeats 3

Results and the commands: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_assets  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from trlx_scale.reliability.sharded_checkpoint import save_sharded  # noqa: E402


def build(name: str):
    config = getattr(bench_assets, name)()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for module in model.modules():
        if type(module).__name__ in set(model._no_split_modules or ()):
            fully_shard(module)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # the moments exist: the checkpoint is what a training run saves
    optimizer.zero_grad()
    return model, optimizer


def consolidated_save(model, optimizer, directory: str) -> None:
    """FULL_STATE_DICT: gather everything on rank 0, rank 0 writes, everyone waits."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        torch.save(model_state, os.path.join(directory, "pytorch_model_fsdp.bin"))
        torch.save(optimizer_state, os.path.join(directory, "optimizer.bin"))
    dist.barrier()


def timed(function) -> float:
    dist.barrier()
    start = time.perf_counter()
    function()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's blocking time
    return elapsed.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama_30m", choices=("llama_30m", "qwen2_05b"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--json-out", default=None)
    cli = parser.parse_args()
    dist.init_process_group("gloo")
    model, optimizer = build(cli.model)
    parameters = sum(p.numel() for p in model.parameters())
    root = tempfile.mkdtemp(dir=cli.dir) if dist.get_rank() == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder)
    root = holder[0]
    times: dict[str, list[float]] = {"consolidated": [], "sharded": [], "async_blocking": [], "async_total": []}
    for repeat in range(cli.repeats):
        times["consolidated"].append(timed(partial(consolidated_save, model, optimizer, f"{root}/full-{repeat}")))
        times["sharded"].append(timed(partial(save_sharded, model, optimizer, f"{root}/sharded-{repeat}")))
        pending: list = []
        start_async = partial(save_sharded, model, optimizer, f"{root}/async-{repeat}", True)
        times["async_blocking"].append(timed(lambda start=start_async, into=pending: into.append(start())))
        times["async_total"].append(timed(pending[0].wait) + times["async_blocking"][-1])
        dist.barrier()
        if dist.get_rank() == 0:
            for kind in ("full", "sharded", "async"):
                shutil.rmtree(f"{root}/{kind}-{repeat}", ignore_errors=True)
    if dist.get_rank() == 0:
        result = {
            "model": cli.model,
            "parameters": parameters,
            "world_size": dist.get_world_size(),
            "checkpoint_gib": round(parameters * 12 / 2**30, 3),
            "median_s": {kind: round(statistics.median(values), 3) for kind, values in times.items()},
            "runs_s": {kind: [round(value, 3) for value in values] for kind, values in times.items()},
        }
        result["consolidated_over_async_blocking"] = round(
            result["median_s"]["consolidated"] / result["median_s"]["async_blocking"], 1
        )
        print(json.dumps(result, indent=1))
        if cli.json_out:
            with open(cli.json_out, "w") as handle:
                json.dump(result, handle, indent=1)
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
