"""Run under torchrun (2 processes, gloo, CPU): the shared-prefix pass under FSDP2 (raw ``fully_shard``: Accelerate
runs FSDP only on accelerators) gives the duplicated pass's log-probs and gradients, with the ranks agreeing per chunk.

    torchrun --nproc_per_node 2 tests/distributed/shared_prefix_fsdp2.py REPORT.json

For each of full fine-tuning and LoRA, with and without gradient checkpointing (transformers' default,
non-reentrant), the embedded model is sharded as Accelerate's FSDP2 shards it (each decoder layer a group, then the
root) and takes two chunks per rank through the trainer's per-chunk decision (``all_ranks_can_share``), then the same
chunks through TRL's duplicated pass; a GRPO-like loss (signed weights on the log-probs, an entropy term) is
backpropagated once per pass, as TRL does. Chunk 0 repeats its prompts on both ranks (shared pass); chunk 1 repeats
them only on rank 0, so both ranks must take the duplicated pass for it (else their forwards, and FSDP's
all-gathers, would not match). Writes a JSON report from rank 0.
"""

import sys

import torch
import torch.distributed as dist
from fsdp2_models import build_fsdp2_model, report_variants  # tests/distributed/ (the script's folder)
from report import finish  # tests/distributed/report.py (the script's folder)
from torch.distributed.tensor import DTensor

from trlx_scale.passes.shared_prefix import all_ranks_can_share, can_share_prefix, shared_prefix_logps

PROMPT_LENGTH, COMPLETION_LENGTH = 7, 5


def chunk(rank: int, index: int, vocabulary: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of different lengths, each repeated with completions of different lengths. Chunk 1 on
    rank 1 has one completion per prompt: nothing to share there."""
    generator = torch.Generator().manual_seed(1000 * rank + index)
    completions = 1 if (index == 1 and rank == 1) else 4
    rows, masks = [], []
    for length in (7, 4, 2):
        prompt = torch.randint(3, vocabulary, (length,), generator=generator)
        for g in range(completions):
            completion = torch.randint(3, vocabulary, (COMPLETION_LENGTH,), generator=generator)
            kept = COMPLETION_LENGTH - (g % COMPLETION_LENGTH)
            pad = PROMPT_LENGTH - length
            rows.append(torch.cat([torch.zeros(pad, dtype=torch.long), prompt, completion]))
            mask = [0] * pad + [1] * length + [1] * kept + [0] * (COMPLETION_LENGTH - kept)
            masks.append(torch.tensor(mask))
    return torch.stack(rows), torch.stack(masks)


def duplicated_logps(model, ids, mask):
    """TRL's pass: every row whole, prompt included."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-COMPLETION_LENGTH] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -COMPLETION_LENGTH:], out.entropy[:, -COMPLETION_LENGTH:]


def run_pass(model, chunks, shared: bool) -> tuple[torch.Tensor, dict, list[bool]]:
    """Log-probs of all chunks, the full gradients of a GRPO-like loss over them, and which chunks shared."""
    model.zero_grad(set_to_none=True)
    losses, logps, decisions = [], [], []
    for ids, mask in chunks:
        use_shared = shared and all_ranks_can_share(can_share_prefix(ids, mask, COMPLETION_LENGTH), collective=True)
        decisions.append(use_shared)
        if use_shared:
            result = shared_prefix_logps(model, ids, mask, COMPLETION_LENGTH, compute_entropy=True)
            assert result is not None
            chunk_logps, entropy = result
        else:
            chunk_logps, entropy = duplicated_logps(model, ids, mask)
        completion_mask = mask[:, -COMPLETION_LENGTH:]
        weights = torch.linspace(-1, 1, ids.size(0))[:, None]  # signed, like advantages
        losses.append(((chunk_logps * weights + 0.1 * entropy) * completion_mask).sum())
        logps.append(chunk_logps.detach())
    torch.stack(losses).sum().backward()
    gradients = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            gradients[name] = grad.detach().clone()
    return torch.cat(logps), gradients, decisions


def compare(kind: str, checkpointing: bool, rank: int) -> dict:
    model = build_fsdp2_model(kind, checkpointing)
    vocabulary = model.config.vocab_size
    chunks = [chunk(rank, index, vocabulary) for index in range(2)]
    shared_logps, shared_grads, decisions = run_pass(model, chunks, shared=True)
    plain_logps, plain_grads, _ = run_pass(model, chunks, shared=False)
    assert shared_grads.keys() == plain_grads.keys()
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in plain_grads.values())).item()
    difference = max((shared_grads[n] - plain_grads[n]).abs().max().item() for n in plain_grads)
    logp_difference = torch.tensor((shared_logps - plain_logps).abs().max().item())
    dist.all_reduce(logp_difference, op=dist.ReduceOp.MAX)
    everyones = [None] * dist.get_world_size()
    dist.all_gather_object(everyones, decisions)
    return {
        "decisions": everyones,
        "trainable_tensors": len(plain_grads),
        "grad_norm": norm,
        "max_grad_difference": difference,
        "max_logp_difference": float(logp_difference),
    }


def main() -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    return report_variants(lambda kind, checkpointing: compare(kind, checkpointing, rank))


if __name__ == "__main__":
    # main() returns first, so the sharded models and their pending collectives are freed while the group is alive.
    finish(main(), sys.argv[1])
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
