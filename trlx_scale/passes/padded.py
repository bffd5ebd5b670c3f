"""``PaddedPass``: TRL's own log-prob pass (each row prompt + completion, padded to the batch's longest), behind the
``LogProbPass`` interface. It is the reference every other pass is tested against, and the fallback of each."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .logprob_pass import PassRequest, PassResult

# TRL's GRPOTrainer._get_per_token_logps_and_entropies, as bound on the trainer (its multimodal inputs as keywords).
TRLPass = Callable[..., tuple]


class PaddedPass:
    name = "padded"

    def __init__(self, trl_pass: TRLPass):
        self._trl_pass = trl_pass

    def run(self, model: torch.nn.Module, request: PassRequest) -> PassResult:
        logps, entropies, aux_loss = self._trl_pass(
            model,
            request.input_ids,
            request.attention_mask,
            request.logits_to_keep,
            batch_size=request.batch_size,
            compute_entropy=request.compute_entropy,
            compute_aux_loss=request.compute_aux_loss,
            **request.extra_inputs,
        )
        rows, width = request.input_ids.shape
        chunk = request.batch_size or rows
        return PassResult(
            logps,
            entropies,
            aux_loss,
            row_lengths=request.attention_mask.sum(dim=-1).detach(),
            processed_tokens=float(rows * width),
            padding_tokens=float(rows * width - request.attention_mask.sum()),
            forwards=-(-rows // chunk),
            row_tokens=width,
        )
