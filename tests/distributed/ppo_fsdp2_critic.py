"""Run under torchrun (2 processes, gloo, CPU): PPO's separate critic sharded by FSDP2 (``DistributedCritic`` with the
'fsdp2' backend, raw ``fully_shard``: Accelerate runs FSDP only on accelerators) trains exactly like one process on the
whole batch, holds half of its parameters and Adam state per rank, and resumes from its checkpoint.

    torchrun --nproc_per_node 2 tests/distributed/ppo_fsdp2_critic.py full|lora REPORT.json

Each rank trains on its half of an 8-row batch; a single-process copy (``backend 'single'``) trains on all 8 rows on
every rank. The value loss is the trainer's: a sum over this rank's tokens divided by every rank's token count,
times the number of ranks (FSDP averages the ranks' gradients). Writes a JSON report from rank 0.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from report import finish  # tests/distributed/report.py (the script's folder)
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from trlx_scale.planning.held_memory import held_bytes
from trlx_scale.ppo.critic import SeparateCritic, critic_state
from trlx_scale.ppo.critic_training import CriticBackend, DistributedCritic
from trlx_scale.tasks.default_model import default_model_path

ROWS, LENGTH, STEPS, MAX_GRAD_NORM = 8, 12, 3, 0.5
VOCABULARY = 64  # token ids below the embedded model's vocabulary size


def build(kind: str, backend: str) -> DistributedCritic:
    torch.manual_seed(0)  # the same LoRA and head initialisation on every rank and in both critics
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    critic = SeparateCritic(model)
    with torch.no_grad():  # a non-zero head: the backbone gets gradients from the first step on
        critic.head.summary.weight.normal_(0.0, 0.05)
    optimizer = torch.optim.AdamW(critic.trainable_parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    world = dist.get_world_size() if backend == "fsdp2" else 1
    return DistributedCritic(
        critic,
        optimizer,
        CriticBackend(backend, num_processes=world),
        max_grad_norm=MAX_GRAD_NORM,
        gradient_accumulation_steps=1,
        micro_batch_size=ROWS // world,
    )


def batch(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    input_ids = torch.randint(3, VOCABULARY, (ROWS, LENGTH), generator=generator)
    attention_mask = torch.ones(ROWS, LENGTH, dtype=torch.long)
    lengths = torch.randint(LENGTH // 2, LENGTH + 1, (ROWS,), generator=generator)
    for row, length in enumerate(lengths.tolist()):
        attention_mask[row, length:] = 0  # rows of different lengths: ranks hold different token counts
    returns = torch.randn(ROWS, LENGTH, generator=generator)
    return input_ids, attention_mask, returns


def train_step(critic: DistributedCritic, step: int, rows: slice) -> tuple[float, float]:
    """One step; returns the global value loss and the gradient norm before clipping."""
    input_ids, attention_mask, returns = batch(step)
    global_count = attention_mask.sum().float()
    input_ids, attention_mask, returns = input_ids[rows], attention_mask[rows], returns[rows]
    values = critic.values(input_ids, attention_mask)
    squared = ((values - returns) ** 2 * attention_mask).sum()
    loss = squared / global_count * critic.num_processes  # this rank's share, scaled for FSDP's average
    critic.backward(loss)
    norm = critic.step()
    total = squared.detach().clone()
    if critic.num_processes > 1:
        dist.all_reduce(total)
    return (total / global_count).item(), float(norm)


def local_fraction(tensors) -> float:
    tensors = list(tensors)
    local = sum(t.to_local().numel() if isinstance(t, DTensor) else t.numel() for t in tensors)
    return local / sum(t.numel() for t in tensors)


def main(kind: str) -> dict:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    single = build(kind, "single")
    sharded = build(kind, "fsdp2")
    initial = critic_state(sharded.critic)
    report = {"kind": kind, "losses": [], "reference_losses": [], "norms": [], "reference_norms": []}
    for step in range(STEPS):
        loss, norm = train_step(sharded, step, rows)
        reference_loss, reference_norm = train_step(single, step, slice(0, ROWS))
        report["losses"].append(loss)
        report["reference_losses"].append(reference_loss)
        report["norms"].append(norm)
        report["reference_norms"].append(reference_norm)
    trained, reference = critic_state(sharded.critic), critic_state(single.critic)
    report["max_param_diff"] = max((trained[n] - reference[n]).abs().max().item() for n in reference)
    # Training moved the backbone, not just the head (the comparison above is not between two untouched models).
    report["backbone_change"] = max((trained[n] - initial[n]).abs().max().item() for n in initial if "head." not in n)
    params = sharded.trainable_parameters()
    report["all_dtensor"] = all(isinstance(p, DTensor) for p in params)
    report["param_fraction"] = local_fraction(params)
    moments = [state[key] for state in sharded.optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]
    report["moment_fraction"] = local_fraction(moments)
    # What a trainer logs as memory/held/critic_gib (planning/held_memory.py): DTensors count by their local shard.
    report["held_ratio"] = held_bytes(sharded.critic, sharded.optimizer) / held_bytes(single.critic, single.optimizer)
    report["optimizer_points_at_shards"] = {id(p) for g in sharded.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in params
    }

    # Resume: save, take one more step; a fresh sharded critic loaded from the checkpoint takes the same step.
    directory = tempfile.mkdtemp() if rank == 0 else None
    holder = [directory]
    dist.broadcast_object_list(holder)
    directory = holder[0]
    state = sharded.save(directory, is_main_process=rank == 0)
    if rank == 0:
        torch.save(state, os.path.join(directory, "critic.pt"))
    dist.barrier()
    report["next_loss"], report["next_norm"] = train_step(sharded, STEPS, rows)
    resumed = build(kind, "fsdp2")
    saved = torch.load(os.path.join(directory, "critic.pt"), map_location="cpu", weights_only=True)
    resumed.load(directory, saved)
    report["resumed_loss"], report["resumed_norm"] = train_step(resumed, STEPS, rows)
    report["saved_keys"] = sorted(saved)
    return report


if __name__ == "__main__":
    # main() returns first, so the sharded models and their pending collectives are freed while the group is alive.
    finish(main(sys.argv[1]), sys.argv[2])
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
