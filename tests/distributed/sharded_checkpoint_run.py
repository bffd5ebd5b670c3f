"""Run under torchrun (1 or 2 processes, gloo, CPU): the embedded model sharded with raw ``fully_shard`` (as
Accelerate's FSDP2 wraps it: each decoder layer, then the root; Accelerate runs FSDP only on accelerators), AdamW,
trained on fixed global batches (each rank takes its rows of the step's batch, so any world size computes the same
global-mean gradient). Saves and resumes through ``trlx_scale.reliability.sharded_checkpoint``.

    torchrun --nproc_per_node N tests/distributed/sharded_checkpoint_run.py REPORT.json PHASE OUTPUT_DIR [options]

PHASE straight  train --steps steps; report every step's loss
PHASE save      train --steps steps, saving checkpoint-S after every step listed in --save_at (synchronously, or with
                --asynchronous in the background; the completion marker with checksums once every rank's shards are
                durable); with --slow_last_save the last save's writer sleeps before writing and the script writes
                OUTPUT_DIR/writing, then waits to be killed
--lora          a LoRA adapter on the model, saved and loaded adapter-only (Accelerate's layout for PEFT models)
PHASE resume    load the newest complete checkpoint of OUTPUT_DIR at this world size, train up to --steps
Rank 0 writes REPORT.json: {"losses": {step: loss}, "resumed_from": ..., "blocking_s": [...], "consolidated_ok": ...}.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from report import finish  # tests/distributed/report.py (the script's folder)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from trlx_scale.reliability.checkpoint_integrity import checksum_files
from trlx_scale.reliability.checkpoints import latest_complete_checkpoint, mark_checkpoint_complete
from trlx_scale.reliability.sharded_checkpoint import (
    consolidated_model_state,
    load_sharded,
    save_sharded,
)
from trlx_scale.tasks.default_model import default_model_path

GLOBAL_BATCH, LENGTH = 8, 12


class SlowWriter(FileSystemWriter):
    """DCP's file writer, 60 s late: a save the test can kill while it is being written."""

    def write_data(self, plan, planner):
        time.sleep(60)
        return super().write_data(plan, planner)


def build(lora: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    for module in model.modules():
        if type(module).__name__ in set(model._no_split_modules or ()):
            fully_shard(module)
    fully_shard(model)
    trained = [param for param in model.parameters() if param.requires_grad]
    return model, torch.optim.AdamW(trained, lr=1e-3, betas=(0.9, 0.95))


def train_step(model, optimizer, step: int) -> float:
    """One step on the step's global batch; this rank's rows; the loss every rank reports is the global mean."""
    generator = torch.Generator().manual_seed(1000 + step)
    batch = torch.randint(3, model.config.vocab_size, (GLOBAL_BATCH, LENGTH), generator=generator)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = batch[rank::world]
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()  # FSDP2 averages gradients over ranks: equal row counts give the global-mean gradient
    optimizer.step()
    optimizer.zero_grad()
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value.item() / world


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("report")
    parser.add_argument("phase", choices=("straight", "save", "resume"))
    parser.add_argument("output_dir")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save_at", type=int, nargs="*", default=[2])
    parser.add_argument("--asynchronous", action="store_true")
    parser.add_argument("--slow_last_save", action="store_true")
    parser.add_argument("--lora", action="store_true", help="a LoRA adapter, saved adapter-only (as Accelerate does)")
    cli = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model, optimizer = build(cli.lora)
    report = {"losses": {}, "resumed_from": None, "blocking_s": [], "world_size": dist.get_world_size()}
    first = 1
    if cli.phase == "resume":
        path = latest_complete_checkpoint(cli.output_dir)
        load_sharded(model, optimizer, path, adapter_only=cli.lora)
        report["resumed_from"] = os.path.basename(path)
        first = int(path.rsplit("-", 1)[1]) + 1
    for step in range(first, cli.steps + 1):
        report["losses"][step] = train_step(model, optimizer, step)
        if cli.phase != "save" or step not in cli.save_at:
            continue
        path = os.path.join(cli.output_dir, f"checkpoint-{step}")
        slow = cli.slow_last_save and step == max(cli.save_at)
        pending = save_sharded(
            model, optimizer, path, cli.asynchronous, SlowWriter if slow else None, adapter_only=cli.lora
        )
        report["blocking_s"].append(pending.blocking_s)
        if slow:
            dist.barrier()
            if dist.get_rank() == 0:
                with open(os.path.join(cli.output_dir, "writing"), "w") as handle:
                    handle.write(str(step))
            time.sleep(600)  # killed here, with the shards still being written
        pending.wait()  # this rank's shards are durable
        dist.barrier()  # ... and every rank's: now the marker
        files = checksum_files(path, dist.get_rank(), dist.get_world_size(), _gather)
        if dist.get_rank() == 0:
            mark_checkpoint_complete(path, step, files)
        dist.barrier()
    # The consolidated weights (what save_model and the Hub get) are the sharded model's full tensors.
    # (A PEFT model's consolidated state is its adapter: the frozen base is never gathered.)
    full = consolidated_model_state(model)  # on rank 0 (the others get {})
    gathered = {
        name: param.full_tensor().cpu()
        for name, param in model.named_parameters()
        if param.requires_grad or not cli.lora
    }
    if dist.get_rank() == 0:
        frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
        report["consolidated_ok"] = (
            set(gathered) <= set(full)  # every parameter (a tied head may add its second name)
            and all(torch.equal(full[n], t) for n, t in gathered.items())
            and (not cli.lora or not frozen & set(full))
        )
    return report


def _gather(items: list) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]


if __name__ == "__main__":
    # main() returns first, so the sharded model and its pending collectives are freed while the group is alive.
    finish(main(), sys.argv[1])
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
