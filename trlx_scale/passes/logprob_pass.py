"""``LogProbPass``: the interface of every log-prob pass, and ``PassResult``, what each returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class PassResult:
    """One pass over a batch of rows.

    ``logps``, ``entropies``: (rows, logits_to_keep), the completion tokens' log-probs and entropies (None unless
    asked); ``aux_loss``: the router's load-balancing loss of a MoE model (None unless asked);
    ``row_lengths``: (rows,) the real (unpadded) tokens of each row; ``token_ratio``: tokens the padded pass would
    process over tokens this pass processed (1.0: as many; a shared-prefix pass processes each prompt once);
    ``chunk_token_ratios``: the same per chunk the pass ran (the ``shared_prefix/token_ratio`` metric)."""

    logps: torch.Tensor
    entropies: torch.Tensor | None
    aux_loss: Any
    row_lengths: torch.Tensor
    token_ratio: float = 1.0
    chunk_token_ratios: list[float] = field(default_factory=list)

    @property
    def as_trl(self) -> tuple:
        """TRL's return value of ``_get_per_token_logps_and_entropies``."""
        return self.logps, self.entropies, self.aux_loss


class LogProbPass(Protocol):
    """A way to compute per-token log-probs of the last ``logits_to_keep`` tokens of each row."""

    name: str

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
    ) -> PassResult: ...
