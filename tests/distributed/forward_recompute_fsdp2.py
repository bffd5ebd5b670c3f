"""Run under torchrun (2 processes, gloo, CPU): packed forwards recomputed in the backward (``recompute_forwards``)
under FSDP2 (raw ``fully_shard``: Accelerate runs FSDP only on accelerators) give the kept forwards' log-probs and
gradients.

    torchrun --nproc_per_node 2 tests/distributed/forward_recompute_fsdp2.py REPORT.json

For full fine-tuning and LoRA, with and without gradient checkpointing (transformers' default, non-reentrant), the
embedded model is sharded as Accelerate's FSDP2 shards it (each decoder layer a group, then the root). Each rank packs
its own rows under a small token budget, rank 0 into more forwards than rank 1, so rank 1 runs the lockstep dummies
(its FSDP all-gathers must match rank 0's, in the forward and in the recompute). A GRPO-like loss (signed weights on
the log-probs, an entropy term) is backpropagated once per pass, with the forwards kept and then recomputed. Writes a
JSON report from rank 0.
"""

import contextlib
import sys

import torch
import torch.distributed as dist
from fsdp2_models import build_fsdp2_model, report_variants  # tests/distributed/ (the script's folder)
from report import finish  # tests/distributed/report.py (the script's folder)
from torch.distributed.tensor import DTensor

from trlx_scale.passes import PackedPass, PassRequest

PROMPT, COMPLETION, BUDGET = 7, 6, 14


def batch(rank: int, vocabulary: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts and right-padded completions of mixed lengths; rank 0 has twice rank 1's rows."""
    generator = torch.Generator().manual_seed(100 + rank)
    rows = 8 if rank == 0 else 4
    ids = torch.randint(3, vocabulary, (rows, PROMPT + COMPLETION), generator=generator)
    mask = torch.ones_like(ids)
    for i in range(rows):
        mask[i, : PROMPT - (7, 3, 5, 2)[i % 4]] = 0
        mask[i, PROMPT + (6, 1, 4, 3, 5)[i % 5] :] = 0
    return ids.masked_fill(mask == 0, 0), mask


def agree_max(value: int) -> int:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def run_pass(model, ids, mask, recompute: bool) -> tuple[torch.Tensor, dict, int, int]:
    model.zero_grad(set_to_none=True)
    packed = PackedPass(
        None, agree_max=agree_max, autocast=contextlib.nullcontext, max_tokens=BUDGET, recompute=recompute
    )
    result = packed.run(model, PassRequest(ids, mask, COMPLETION, compute_entropy=True))
    weights = torch.linspace(-1, 1, ids.size(0))[:, None]  # signed, like advantages
    ((result.logps * weights + 0.1 * result.entropies) * mask[:, -COMPLETION:]).sum().backward()
    gradients = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            gradients[name] = grad.detach().clone()
    return result.logps.detach(), gradients, result.forwards, result.recomputed_forwards


def compare(kind: str, checkpointing: bool, rank: int) -> dict:
    model = build_fsdp2_model(kind, checkpointing, attn_implementation="sdpa")
    ids, mask = batch(rank, model.config.vocab_size)
    kept_logps, kept_grads, forwards, kept_recomputed = run_pass(model, ids, mask, recompute=False)
    logps, grads, _, recomputed = run_pass(model, ids, mask, recompute=True)
    assert grads.keys() == kept_grads.keys()
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in kept_grads.values())).item()
    difference = max((grads[n] - kept_grads[n]).abs().max().item() for n in kept_grads)
    logp_difference = torch.tensor((logps - kept_logps).abs().max().item())
    dist.all_reduce(logp_difference, op=dist.ReduceOp.MAX)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, {"forwards": forwards, "recomputed": recomputed, "kept": kept_recomputed})
    return {
        "counts": counts,
        "trainable_tensors": len(kept_grads),
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
