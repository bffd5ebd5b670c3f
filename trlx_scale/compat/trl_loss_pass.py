"""The micro-batch of the loss pass in progress, where TRL hands the pass none.

Why: TRL 1.16's ``GRPOTrainer._compute_loss(model, inputs)`` computes the loss pass's log-probs by calling
``self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, ...)`` with token ids and masks only, and
forms the importance ratios inline right after. What trlx_scale does in between needs the micro-batch: vLLM's
importance-sampling correction from the loss pass (``old_logprobs_from_loss_pass``) and GSPO-token's shift
(``_postprocess_loss_logps``). The trainer's ``_compute_loss`` binds ``inputs`` here for the duration of TRL's call
(a ``ContextVar``: nothing of a micro-batch outlives its call or is seen by another thread, and no TRL call order is
assumed), and the pass reads it.

Covered: TRL 1.16 (checked: 1.16.0). ``tests/test_trl_contract.py`` fails when TRL's ``_compute_loss`` stops calling
the log-prob pass without the batch (then the batch can be passed instead and this module can go).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

TESTED_TRL = ("1.16",)

_LOSS_PASS_BATCH: ContextVar[dict | None] = ContextVar("trlx_scale_loss_pass_batch", default=None)


@contextlib.contextmanager
def loss_pass_of(inputs: dict) -> Iterator[None]:
    """Bind ``inputs`` as the micro-batch of the loss pass TRL's ``_compute_loss`` runs inside this block."""
    token = _LOSS_PASS_BATCH.set(inputs)
    try:
        yield
    finally:
        _LOSS_PASS_BATCH.reset(token)


def loss_pass_batch() -> dict | None:
    """The micro-batch of the ``_compute_loss`` call in progress (None outside one: a rollout's passes)."""
    return _LOSS_PASS_BATCH.get()
