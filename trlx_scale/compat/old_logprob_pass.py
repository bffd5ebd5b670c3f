"""Skip TRL's old-policy log-prob pass for one rollout, when the loss pass will compute the same log-probs.

Why: TRL 1.16's ``GRPOTrainer._generate_and_score_completions`` runs an extra no-grad forward over the whole batch
(``old_per_token_logps``) whenever vLLM's importance-sampling correction is on, even when generation and optimizer
steps are aligned, i.e. when every loss pass over the batch runs with the weights that generated it. Then the pass
recomputes what the loss pass computes anyway (TRL itself uses the loss pass's detached log-probs as the old ones in
that case without vLLM). TRL leaves no hook to skip it: its condition reads the trainer's own
``vllm_importance_sampling_correction`` attribute.

The workaround: that attribute is off on the trainer instance for the duration of that one call, so TRL takes its
aligned branch (no pass, ``old_per_token_logps`` None, no ratio, no ``sampling/*`` metrics; vLLM's own log-probs
still ride in the batch as ``sampling_per_token_logps``). It is restored before the loss pass, where TRL multiplies by
``inputs["importance_sampling_ratio"]``, which ``GRPOTrainer`` fills from the loss pass's log-probs
(``losses.vllm_importance_sampling``). No TRL module or class is modified.

Covered: TRL 1.16 (checked: 1.16.0). ``tests/test_trl_contract.py`` fails when the lines this relies on change.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import trl

TESTED_TRL = ("1.16",)
ATTRIBUTE = "vllm_importance_sampling_correction"


def supported() -> bool:
    """Whether this TRL is one whose old-pass condition this module was checked against."""
    return trl.__version__.startswith(TESTED_TRL)


@contextmanager
def old_logprob_pass_skipped(trainer: Any) -> Iterator[None]:
    """Within the block, TRL's rollout sees the correction off (see the module docstring)."""
    if not getattr(trainer, ATTRIBUTE):
        raise RuntimeError("old_logprob_pass_skipped is only for runs with vLLM's importance-sampling correction on.")
    setattr(trainer, ATTRIBUTE, False)
    try:
        yield
    finally:
        setattr(trainer, ATTRIBUTE, True)
