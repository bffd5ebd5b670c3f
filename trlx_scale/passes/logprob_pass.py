"""``LogProbPass``: the interface of every log-prob pass; ``PassRequest``, what it is asked; ``PassResult``, what it
returns."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch


@dataclass
class PassRequest:
    """Rows to score: ``input_ids``/``attention_mask`` (rows, prompt + completion tokens), of which the last
    ``logits_to_keep`` are the completion; ``batch_size`` rows per forward (None: all at once); the entropies and
    a MoE router's load-balancing loss when asked; ``extra_inputs``: TRL's multimodal inputs (None when absent)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int
    batch_size: int | None = None
    compute_entropy: bool = False
    compute_aux_loss: bool = False
    extra_inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def has_extra_inputs(self) -> bool:
        return self.compute_aux_loss or any(value is not None for value in self.extra_inputs.values())

    def rows(self, start: int, stop: int) -> PassRequest:
        """The same request for rows ``start:stop``, in one forward."""
        return replace(
            self,
            input_ids=self.input_ids[start:stop],
            attention_mask=self.attention_mask[start:stop],
            batch_size=None,
        )


@dataclass
class PassResult:
    """One pass over a batch of rows.

    ``logps``, ``entropies``: (rows, logits_to_keep), the completion tokens' log-probs and entropies (None unless
    asked); ``aux_loss``: the router's load-balancing loss of a MoE model (None unless asked);
    ``row_lengths``: (rows,) the real (unpadded) tokens of each row; ``token_ratio``: tokens the padded pass would
    process over tokens this pass processed (1.0: as many; a shared-prefix pass processes each prompt once);
    ``chunk_token_ratios``: the same per chunk the pass ran (the ``shared_prefix/token_ratio`` metric);
    ``processed_tokens``: token positions the forwards ran, ``padding_tokens``: those of them no sample owns (padding,
    a packed row's filler: the ``batch/pad_frac`` metric); ``forwards``: model calls; ``oversize_samples``: samples longer than
    the packing budget (each alone in its row); ``row_tokens``: the width of the rows the forwards ran;
    ``recomputed_forwards``: forwards whose activations the backward recomputes (``recompute_forwards``)."""

    logps: torch.Tensor
    entropies: torch.Tensor | None
    aux_loss: Any
    row_lengths: torch.Tensor
    token_ratio: float = 1.0
    chunk_token_ratios: list[float] = field(default_factory=list)
    processed_tokens: float = 0.0
    padding_tokens: float = 0.0
    forwards: int = 1
    oversize_samples: int = 0
    row_tokens: int = 0
    recomputed_forwards: int = 0


class LogProbPass(Protocol):
    """A way to compute per-token log-probs of the completion tokens of each row."""

    name: str

    def run(self, model: torch.nn.Module, request: PassRequest) -> PassResult: ...
