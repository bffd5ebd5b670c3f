"""``PackedRows``: a batch of padded (prompt, completion) rows laid out padding-free, and the way back.

TRL's rows are ``[left-padded prompt | right-padded completion]``, every row as wide as the longest. Here each
sample's real tokens (its ``attention_mask``) are concatenated into packed rows with ``position_ids`` restarting at
0 for every sample and **no** ``attention_mask``: transformers then detects the packing from the positions and gives
each sample a block of its own (``masking_utils.find_packed_sequence_indices``; flash-attention's varlen path on GPU
reads the same positions). Two things turn that detection off and let samples attend to each other: a KV cache and
any attention mask, an all-ones one included; the forwards here pass neither (``use_cache=False``), and
``packing_support.check_packing_isolated`` verifies once per run, on the model itself, that samples stay apart.

The micro-batch planner (``micro_batch_plan``) cuts the samples into bins of at most ``row_tokens`` tokens; each bin
is one packed row, completed to the width of its forward's fullest row by one filler segment (its own positions from
0, no label), so the only tokens processed that no sample owns are the bins' slack. Rows go through the model ``rows_per_forward`` at a
time. Per-position outputs come back to the padded grid with ``to_grid`` (zeros where the grid has padding), so the
loss, its masks and its normalisers see exactly the tensors of the padded pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .micro_batch_plan import choose_row_width, plan_micro_batches


@dataclass
class PackedForward:
    """One forward: ``input_ids``/``position_ids``/``labels`` (rows, row_tokens); ``labels`` is -100 except at the
    scored (completion) tokens, in TRL's convention (the fused LM head shifts them)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    sample_tokens: torch.Tensor  # (rows, row_tokens) bool: the positions a sample owns (not the filler)

    @property
    def scored(self) -> torch.Tensor:
        """Where the fused head's (rows, row_tokens - 1) outputs hold a scored token's value."""
        return self.labels[:, 1:] != -100


@dataclass
class PackedRows:
    """The packed layout of one request (see the module docstring)."""

    forwards: list[PackedForward]
    order: torch.Tensor  # the samples in packed order (row by row, forward by forward)
    lengths: torch.Tensor  # (rows of the grid,) real tokens of each sample
    grid_mask: torch.Tensor  # (rows, width) the padded grid's attention mask, bool
    scored_grid: torch.Tensor  # (rows, width) bool: the grid's scored tokens
    completion_width: int
    row_tokens: int  # the widest forward's width
    oversize: int  # samples longer than the token budget (each alone in its row)

    @classmethod
    def build(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        completion_width: int | None = None,
        *,
        labels: torch.Tensor | None = None,
        max_tokens: int | None = None,
        forward_tokens: int | None = None,
        coefficient: float | None = None,
    ) -> PackedRows:
        """Pack the rows of a padded batch. ``completion_width``: its last columns that are the completion (TRL's
        GRPO ``logits_to_keep``), or ``labels``: the grid's labels, -100 where a token is not scored (TRL's DPO); ``max_tokens``: the most tokens in one packed row (None: the longest sample, so no
        packed row is wider than the padded one); ``forward_tokens``: the most tokens in one forward (None: all
        rows at once); ``coefficient``: the model's ``attention_cost_coefficient`` — with it and no ``max_tokens``, the
        rows take the width that costs least (``choose_row_width``: a little wider than the longest sample where that
        saves a row), without it they are as wide as the longest sample."""
        mask = attention_mask.bool()
        lengths = mask.sum(dim=-1)
        length_list = lengths.tolist()
        longest = max(length_list, default=1)
        if max_tokens is not None:
            row_tokens = max_tokens
        elif coefficient is not None:
            row_tokens = choose_row_width(length_list, coefficient, max_width=forward_tokens)
        else:
            row_tokens = max(longest, 1)
        plan = plan_micro_batches(length_list, num_ranks=1, max_tokens=row_tokens)
        bins = [b for b in plan.micro_batches[0] if b]
        row_tokens = max(row_tokens, longest)  # an oversize sample widens the rows it shares a forward with
        rows_per_forward = len(bins) if forward_tokens is None else max(1, forward_tokens // row_tokens)

        if labels is None:
            completion = torch.zeros_like(mask)
            completion[:, -completion_width:] = True
            labels_grid = input_ids.masked_fill(~(mask & completion), -100)
        else:
            labels_grid = labels.masked_fill(~mask, -100)
        positions = mask.long().cumsum(dim=-1) - 1  # each sample's own positions, from 0
        # A sample's first token has nothing of its own before it (in a packed row: another sample): never scored.
        labels_grid = labels_grid.masked_fill(mask & (positions == 0), -100)
        tokens = [input_ids[i][mask[i]] for i in range(input_ids.size(0))]
        sample_positions = [positions[i][mask[i]] for i in range(input_ids.size(0))]
        sample_labels = [labels_grid[i][mask[i]] for i in range(input_ids.size(0))]

        forwards = []
        for start in range(0, len(bins), rows_per_forward):
            ids_rows, pos_rows, label_rows, owned_rows = [], [], [], []
            chunk = bins[start : start + rows_per_forward]
            # A forward is as wide as its fullest row (at most row_tokens): no filler beyond what a row lacks.
            width = max(sum(length_list[i] for i in packed) for packed in chunk)
            for packed in chunk:
                slack = width - sum(length_list[i] for i in packed)
                filler = input_ids.new_zeros(slack)
                ids_rows.append(torch.cat([*(tokens[i] for i in packed), filler]))
                pos_rows.append(torch.cat([*(sample_positions[i] for i in packed), torch.arange(slack).to(filler)]))
                label_rows.append(torch.cat([*(sample_labels[i] for i in packed), filler.new_full((slack,), -100)]))
                owned = torch.ones(width, dtype=torch.bool, device=input_ids.device)
                owned[width - slack :] = False
                owned_rows.append(owned)
            forwards.append(
                PackedForward(
                    torch.stack(ids_rows), torch.stack(pos_rows), torch.stack(label_rows), torch.stack(owned_rows)
                )
            )
        order = torch.tensor([i for packed in bins for i in packed], dtype=torch.long, device=input_ids.device)
        return cls(
            forwards=forwards,
            order=order,
            lengths=lengths,
            grid_mask=mask,
            scored_grid=labels_grid != -100,
            completion_width=completion_width or 0,
            row_tokens=max(f.input_ids.size(1) for f in forwards),
            oversize=len(plan.oversize),
        )

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def processed_tokens(self) -> int:
        return sum(f.input_ids.numel() for f in self.forwards)

    def completion_values(self, per_forward: list[torch.Tensor]) -> torch.Tensor:
        """(rows, completion_width) from the fused head's per-forward (rows, row_tokens - 1) outputs: each scored
        token's value where the padded pass has it, zeros at the padding."""
        values = torch.cat([out[f.scored] for out, f in zip(per_forward, self.forwards, strict=True)])
        return self._scatter(values, self.scored_grid[:, -self.completion_width :])

    def shifted_values(self, per_forward: list[torch.Tensor]) -> torch.Tensor:
        """(rows, width - 1) from the fused head's per-forward outputs, on the padded grid's fused-head layout
        (column t: the token at t + 1), zeros where no token is scored: what the padded forward returns."""
        values = torch.cat([out[f.scored] for out, f in zip(per_forward, self.forwards, strict=True)])
        return self._scatter(values, self.scored_grid[:, 1:])

    def position_values(self, per_forward: list[torch.Tensor]) -> torch.Tensor:
        """(rows, width) from per-forward (rows, row_tokens) per-position outputs (a value head's): each sample's
        positions where the padded grid has them, zeros at the padding."""
        values = torch.cat([out[f.sample_tokens] for out, f in zip(per_forward, self.forwards, strict=True)])
        return self._scatter(values, self.grid_mask)

    def _scatter(self, values: torch.Tensor, grid_mask: torch.Tensor) -> torch.Tensor:
        return scatter_to_grid(values, grid_mask, self.order)


def scatter_to_grid(values: torch.Tensor, grid_mask: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Place ``values`` on the grid: they are the True positions of ``grid_mask``, row by row in ``order`` (each
    row's in column order), as a packed layout visits them. Differentiable in ``values``; zeros elsewhere."""
    rows, width = grid_mask.shape
    flat = torch.arange(rows * width, device=grid_mask.device).view(rows, width)
    target = flat.index_select(0, order)[grid_mask.index_select(0, order)]
    out = values.new_zeros(rows * width)
    return out.index_copy(0, target, values).view(rows, width)


def lockstep_dummy(model: torch.nn.Module, ids: torch.Tensor, autocast: Callable | None = None) -> torch.Tensor:
    """A two-token forward whose scalar result a caller adds times zero: under sharded parameters a rank with fewer
    forwards than another runs these, so its collectives (forward and backward) stay in step with the others'."""
    tokens = ids[:1, :2] if ids.size(1) >= 2 else ids.new_zeros(1, 2)
    labels = tokens.clone()
    labels[:, 0] = -100
    positions = torch.arange(2, device=ids.device).unsqueeze(0)
    with autocast() if autocast is not None else contextlib.nullcontext():
        outputs = model(input_ids=tokens, position_ids=positions, labels=labels, fused_lm_head=True, use_cache=False)
    return outputs.log_probs.sum()


def forward_token_limit(
    chunk_rows: int | None, padded_width: int, max_tokens: int | None, one_forward: bool = False
) -> int | None:
    """The most tokens one packed forward may hold: TRL's chunk (``chunk_rows`` rows of the padded width, None: the
    whole request), capped by ``max_tokens_per_microbatch``; None (one forward) where ``one_forward`` (a pass with
    gradients under ZeRO-3 with reentrant checkpointing: ``passes.packed``)."""
    if one_forward:
        return None
    limit = None if chunk_rows is None else chunk_rows * padded_width
    if max_tokens is not None:
        limit = max_tokens if limit is None else min(limit, max_tokens)
    return limit
