"""``run_forward``: one packed forward of a pass with gradients, optionally recomputed in the backward instead of kept.

A loss pass over packed rows runs several forwards (its rows under ``max_tokens_per_microbatch``), and TRL's loss
spans all of them: every forward's graph (its layers' saved activations, the LM head's saved tensors) lives until the
micro-batch's one backward. So the budget alone bounds one forward's transient memory (attention scores, the head's
tiles), not what the micro-batch keeps. With ``recompute_forwards`` each forward runs under
``torch.utils.checkpoint`` instead: it keeps only its inputs (token ids, positions, labels) and its per-token outputs,
and the backward re-runs it when it reaches it, one forward at a time, freeing each one's graph before the next. A
micro-batch then keeps one forward's activations whatever its size: the budget becomes a memory bound, as verl's
``ppo_max_token_len_per_gpu`` is. The price is one more forward per micro-batch (docs/benchmarks.md).

Why non-reentrant checkpointing: the backward stays one autograd pass over one graph, so every parameter's gradient
is accumulated once per micro-batch (DDP's bucket hooks and FSDP2's reduce-scatter fire as they do without it), the
model's own layer checkpointing nests inside it, and the autocast and RNG state of the forward are restored for the
recompute. The recompute reproduces the forward's values (same inputs, same kernels), so the gradient is the one
without it (tests/test_forward_recompute.py).

Sharded parameters: the recompute gathers the weights again (FSDP2's all-gathers), so the ranks must recompute the
same forwards. The passes agree on the forward count before running them and run their lockstep dummies through
``run_forward`` too (verified under FSDP2: tests/distributed/forward_recompute_fsdp2.py). DeepSpeed ZeRO-3 is refused
by the trainer: TRL's fused LM head reads DeepSpeed's attributes on the weight it saved, which a recomputed forward's
saved tensors lack.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils.checkpoint import checkpoint

Outputs = TypeVar("Outputs")


def run_forward(forward: Callable[..., Outputs], *tensors: torch.Tensor, recompute: bool) -> Outputs:
    """``forward(*tensors)``; with ``recompute`` (and gradients enabled) its activations are not kept for the
    backward but recomputed there (see the module docstring). ``forward`` must be a pure function of ``tensors``
    and the model's parameters: the backward calls it again."""
    if not recompute or not torch.is_grad_enabled():
        return forward(*tensors)
    return checkpoint(forward, *tensors, use_reentrant=False)


def recomputes(recompute: bool, forwards: int) -> bool:
    """Whether a pass of ``forwards`` model calls recomputes them: only a pass with gradients and more than one
    forward (a single forward's graph is the micro-batch's anyway: recomputing it would only add a forward)."""
    return recompute and forwards > 1 and torch.is_grad_enabled()
