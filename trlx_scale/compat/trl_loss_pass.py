"""The micro-batch of the loss pass in progress, where TRL hands the pass none.

Why: TRL 1.16's ``GRPOTrainer._compute_loss(model, inputs)`` computes the loss pass's log-probs by calling
``self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, ...)`` with token ids and masks only, and
forms the importance ratios inline right after. What trlx_scale does in between needs the micro-batch: vLLM's
importance-sampling correction from the loss pass (``old_logprobs_from_loss_pass``) and GSPO-token's shift
(``_postprocess_loss_logps``); and PPO's approximate KL needs the pass's log-probs back after TRL's loss. The
trainer's ``_compute_loss`` binds a ``LossPass`` (the micro-batch, and the log-probs the pass leaves in it) for the
duration of TRL's call (a ``ContextVar``: nothing of a micro-batch outlives its call or is seen by another thread,
and no TRL call order is assumed); the pass reads the batch and records its log-probs there.

Covered: TRL 1.16 (checked: 1.16.0). ``tests/test_trl_contract.py`` fails when TRL's ``_compute_loss`` stops calling
the log-prob pass without the batch (then the batch can be passed instead and this module can go).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

TESTED_TRL = ("1.16",)


@dataclass
class LossPass:
    """One ``_compute_loss`` call's loss pass: its micro-batch, and the per-token log-probs the pass computed
    (detached; None until the pass ran)."""

    batch: dict
    logps: Any = None


_LOSS_PASS: ContextVar[LossPass | None] = ContextVar("trlx_scale_loss_pass", default=None)


@contextlib.contextmanager
def loss_pass_of(inputs: dict) -> Iterator[LossPass]:
    """Bind ``inputs`` as the micro-batch of the loss pass TRL's ``_compute_loss`` runs inside this block (the one
    already bound, where an outer override bound the same batch)."""
    current = _LOSS_PASS.get()
    if current is not None and current.batch is inputs:
        yield current
        return
    loss_pass = LossPass(inputs)
    token = _LOSS_PASS.set(loss_pass)
    try:
        yield loss_pass
    finally:
        _LOSS_PASS.reset(token)


def current_loss_pass() -> LossPass | None:
    """The loss pass of the ``_compute_loss`` call in progress (None outside one: a rollout's passes)."""
    return _LOSS_PASS.get()


def loss_pass_batch() -> dict | None:
    """The micro-batch of the ``_compute_loss`` call in progress (None outside one)."""
    loss_pass = _LOSS_PASS.get()
    return None if loss_pass is None else loss_pass.batch
