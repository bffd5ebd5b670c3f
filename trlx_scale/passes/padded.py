"""``PaddedPass``: TRL's own log-prob pass (each row prompt + completion, padded to the batch's longest), behind the
``LogProbPass`` interface. It is the reference every other pass is tested against, and the fallback of each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .logprob_pass import PassResult

# TRL's GRPOTrainer._get_per_token_logps_and_entropies, as bound on the trainer (its multimodal inputs as keywords).
TRLPass = Callable[..., tuple]


class PaddedPass:
    name = "padded"

    def __init__(self, trl_pass: TRLPass):
        self._trl_pass = trl_pass

    def run(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None,
        compute_entropy: bool,
        compute_aux_loss: bool,
        extra_inputs: dict[str, Any],
    ) -> PassResult:
        logps, entropies, aux_loss = self._trl_pass(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss,
            **extra_inputs,
        )
        return PassResult(logps, entropies, aux_loss, row_lengths=attention_mask.sum(dim=-1).detach())
