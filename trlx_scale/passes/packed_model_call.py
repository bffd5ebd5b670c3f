"""``PackedModelCall``: a model called as TRL's DPO calls it, run on padding-free packed rows.

TRL's ``DPOTrainer._compute_loss`` calls ``model(input_ids=, attention_mask=, labels=, fused_lm_head=True)`` on the
chosen and rejected rows (one batch: chosen then rejected, right-padded) and reads the fused head's ``log_probs``;
its ``compute_ref_log_probs(model, inputs)`` does the same for the reference. Both take the model as an argument, so
the trainer hands them this object instead: the same call, run on packed rows (``packed_rows``), the result on the
padded grid, so TRL's sums, its ``ld_alpha`` split and every loss type see the padded forward's tensors.

A call with anything else (image inputs, router logits for a MoE aux loss, no fused head) goes to the model as is.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from trl.trainer.utils import FusedCausalLMOutput

from .forward_recompute import recomputes, run_forward
from .packed_rows import PackedRows, lockstep_dummy

PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_PACKABLE_KEYWORDS = {"input_ids", "attention_mask", "labels", "fused_lm_head", "use_cache"}


class PackedModelCall:
    """Args:
    model: the (wrapped) model with TRL's fused LM head.
    agree_max: the largest of the ranks' values (forward counts under sharded parameters; see ``passes.packed``).
    max_tokens: ``max_tokens_per_microbatch`` (None: rows as wide as the longest sample, all in one forward).
    on_pass: called with each packed call's ``PackedRows`` and how many of its forwards the backward recomputes
        (the trainer's metrics).
    coefficient: the model's ``attention_cost_coefficient``: rows of the cheapest width (``choose_row_width``).
    recompute: ``recompute_forwards``: a call with gradients and several forwards recomputes each in the backward
        (``forward_recompute``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        agree_max: Callable[[int], int],
        max_tokens: int | None = None,
        on_pass: Callable[[PackedRows, int], None] | None = None,
        coefficient: float | None = None,
        recompute: bool = False,
    ):
        self.model = model
        self._recompute = recompute
        self._coefficient = coefficient
        self._agree_max = agree_max
        self._max_tokens = max_tokens
        self._on_pass = on_pass

    def __call__(self, **kwargs: Any) -> Any:
        if set(kwargs) - _PACKABLE_KEYWORDS or not kwargs.get("fused_lm_head") or kwargs.get("labels") is None:
            return self.model(**kwargs)
        ids, mask, labels = kwargs["input_ids"], kwargs["attention_mask"], kwargs["labels"]
        rows = PackedRows.build(
            ids,
            mask,
            labels=labels,
            max_tokens=self._max_tokens,
            forward_tokens=self._max_tokens,
            coefficient=self._coefficient,
        )
        forwards = self._agree_max(len(rows.forwards))  # first: the ranks then agree on the recompute
        recompute = recomputes(self._recompute, forwards)

        def forward_pass(input_ids, position_ids, labels):
            outputs = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                labels=labels,
                fused_lm_head=True,
                use_cache=False,  # a cache turns transformers' packing detection off
            )
            return tuple(getattr(outputs, field) for field in PER_TOKEN_FIELDS)

        per_forward: dict[str, list[torch.Tensor]] = {field: [] for field in PER_TOKEN_FIELDS}
        for forward in rows.forwards:
            outputs = run_forward(
                forward_pass, forward.input_ids, forward.position_ids, forward.labels, recompute=recompute
            )
            for field, value in zip(PER_TOKEN_FIELDS, outputs, strict=True):
                per_forward[field].append(value)
        # Each per-token field the head computed (log-probs always; entropies etc. as add_fused_lm_head asked).
        fields = {
            field: rows.shifted_values(values) if values[0] is not None else None
            for field, values in per_forward.items()
        }
        for _ in range(forwards - len(rows.forwards)):
            dummy = run_forward(partial(lockstep_dummy, self.model), ids, recompute=recompute)
            fields["log_probs"] = fields["log_probs"] + 0.0 * dummy
        if self._on_pass is not None:
            self._on_pass(rows, len(rows.forwards) if recompute else 0)
        return FusedCausalLMOutput(**fields, label_mask=rows.scored_grid[:, 1:])
