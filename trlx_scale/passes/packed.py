"""``PackedPass``: the log-prob pass over padding-free packed rows (``packed_rows``), behind ``LogProbPass``.

The request's rows keep their micro-batch (TRL's): packing changes how they go through the model, not which rows a
loss sees, so every TRL ``loss_type``'s normaliser (per sequence, per token of the micro-batch, ``dapo``'s global
count) and GSPO's are the padded pass's, and the log-probs come back on the padded grid, equal up to float rounding
(tests/test_packing.py: every loss type, GRPO/PPO/DPO, 1 and 2 processes).

Sharded parameters (ZeRO-3, FSDP2): each forward gathers weights with collectives, so every rank runs as many
forwards as the rank with the most (``agree_max``); a rank with fewer runs a two-token dummy forward whose output
enters the result times zero, so its backward (and its collectives) run too. One exception: under ZeRO-3 with
reentrant gradient checkpointing (TRL forces it for PEFT models), each forward's recompute reduces the parameters'
gradients on its own and DeepSpeed refuses a parameter twice in one bucket; there a pass with gradients runs all its
packed rows in one forward (``one_forward_with_grad``), the rows still as narrow as the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from .forward_recompute import recomputes, run_forward
from .logprob_pass import PassRequest, PassResult
from .packed_rows import PackedRows, forward_token_limit, lockstep_dummy


class PackedPass:
    """Args:
    padded: the pass for requests packing does not cover (a router loss, image inputs): ``PaddedPass``.
    agree_max: the largest of the ranks' values (the identity when parameters are not sharded).
    autocast: the trainer's autocast context (``accelerator.autocast``).
    max_tokens: ``max_tokens_per_microbatch``: the most tokens of one packed row (None: the longest sample's).
    one_forward_with_grad: run a pass with gradients as one forward (see the module docstring).
    coefficient: the model's ``attention_cost_coefficient``: rows of the cheapest width (``choose_row_width``);
        None: rows as wide as the longest sample.
    recompute: ``recompute_forwards``: a pass with gradients and several forwards recomputes each in the backward
        instead of keeping its activations (``forward_recompute``).
    """

    name = "packed"

    def __init__(
        self,
        padded,
        agree_max: Callable[[int], int],
        autocast: Callable,
        max_tokens: int | None = None,
        one_forward_with_grad: bool = False,
        coefficient: float | None = None,
        recompute: bool = False,
    ):
        self._recompute = recompute
        self._one_forward_with_grad = one_forward_with_grad
        self._coefficient = coefficient
        self._padded = padded
        self._agree_max = agree_max
        self._autocast = autocast
        self._max_tokens = max_tokens

    def run(self, model: torch.nn.Module, request: PassRequest) -> PassResult:
        if request.has_extra_inputs:
            return self._padded.run(model, request)
        ids, mask = request.input_ids, request.attention_mask
        one_forward = self._one_forward_with_grad and torch.is_grad_enabled()
        forward_tokens = forward_token_limit(request.batch_size, ids.size(1), self._max_tokens, one_forward)
        rows = PackedRows.build(
            ids,
            mask,
            request.logits_to_keep,
            max_tokens=self._max_tokens,
            forward_tokens=forward_tokens,
            coefficient=self._coefficient,
        )
        # The ranks agree on the forward count first (sharded parameters: dummies keep them in lockstep), so they
        # agree on the recompute too: its forwards in the backward gather the weights as the first ones did.
        forwards = self._agree_max(len(rows.forwards))
        recompute = recomputes(self._recompute, forwards)

        def forward_pass(input_ids, position_ids, labels):
            with self._autocast():
                outputs = model(
                    input_ids=input_ids,
                    position_ids=position_ids,
                    labels=labels,
                    fused_lm_head=True,
                    use_cache=False,  # a cache turns transformers' packing detection off
                )
            return outputs.log_probs, outputs.entropy if request.compute_entropy else None

        logps, entropies = [], []
        for forward in rows.forwards:
            log_probs, entropy = run_forward(
                forward_pass, forward.input_ids, forward.position_ids, forward.labels, recompute=recompute
            )
            logps.append(log_probs)
            entropies.append(entropy)
        result_logps = rows.completion_values(logps)
        for _ in range(forwards - len(rows.forwards)):
            dummy = run_forward(partial(lockstep_dummy, model, autocast=self._autocast), ids, recompute=recompute)
            result_logps = result_logps + 0.0 * dummy
        return PassResult(
            logps=result_logps,
            entropies=rows.completion_values(entropies) if request.compute_entropy else None,
            aux_loss=None,
            row_lengths=rows.lengths.detach(),
            processed_tokens=rows.processed_tokens,
            padding_tokens=float(rows.processed_tokens - rows.real_tokens),
            forwards=len(rows.forwards),
            oversize_samples=rows.oversize,
            row_tokens=rows.row_tokens,
            recomputed_forwards=len(rows.forwards) if recompute else 0,
        )
