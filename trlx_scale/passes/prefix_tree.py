"""``PrefixTreePass``: packed rows in which each GRPO group's prompt is forwarded once (a tree attention mask).

With both ``padding_free`` and ``shared_prefix`` on, a group of G completions of one prompt becomes one tree:

    [prompt without its last token] [last prompt token, completion 1] ... [last prompt token, completion G]

Positions follow each branch's own sequence (the prompt's from 0, a branch continuing from the prompt's length - 1,
as the full row would), and a 4D attention mask lets each token see the tokens before it in the shared prompt and in
its own branch only. The prompt's last token leads every branch (its hidden state predicts the first completion
token, and each branch needs its own copy: G tokens per group, against the G x prompt the duplicated rows cost).
Trees are packed into rows first-fit-decreasing (``micro_batch_plan``), each row at most as wide as the longest tree
(or ``max_tokens_per_microbatch``); a row's slack is a filler tree. The completion tokens' values come back onto the
padded grid (``packed_rows.scatter_to_grid``), so the loss sees the padded pass's tensors.

The mask is a dense (rows, 1, W, W) one: sdpa takes it as booleans, eager as an additive float mask;
flash-attention's varlen kernel has no tree masks, so there the shared-prefix pass over packed rows is used instead
(``PrefixTreePass.supports``). Exact up to float rounding (tests/test_packing.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from .forward_recompute import recomputes, run_forward
from .logprob_pass import PassRequest, PassResult
from .micro_batch_plan import choose_row_width, plan_micro_batches
from .packed_rows import forward_token_limit, lockstep_dummy, scatter_to_grid
from .packing_support import attention_implementation
from .shared_prefix import find_prompt_groups


@dataclass
class TreeForward:
    input_ids: torch.Tensor  # (rows, width)
    position_ids: torch.Tensor
    labels: torch.Tensor  # -100 except at completion tokens
    attention_mask: torch.Tensor  # (rows, 1, width, width) bool: query attends to key

    @property
    def scored(self) -> torch.Tensor:
        return self.labels[:, 1:] != -100


@dataclass
class PrefixTreeRows:
    forwards: list[TreeForward]
    order: torch.Tensor  # the samples in packed order
    scored_grid: torch.Tensor  # (rows, completion_width) the grid's scored completion tokens
    lengths: torch.Tensor
    processed_tokens: int
    owned_tokens: int  # positions a tree owns (prompts once, branches), the rest is filler

    @classmethod
    def build(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        completion_width: int,
        max_tokens: int | None = None,
        forward_tokens: int | None = None,
        coefficient: float | None = None,
    ) -> PrefixTreeRows:
        """``max_tokens``, ``forward_tokens`` and ``coefficient`` as in ``PackedRows.build``, with trees for samples."""
        mask = attention_mask.bool()
        prompt_width = input_ids.size(1) - completion_width
        groups = find_prompt_groups(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])
        members: list[list[int]] = [[] for _ in range(groups.num_groups)]
        for row, group in enumerate(groups.row_group.tolist()):
            members[group].append(row)
        prompt_tokens = [input_ids[m[0], :prompt_width][mask[m[0], :prompt_width]] for m in members]
        completion_tokens = [input_ids[i, prompt_width:][mask[i, prompt_width:]] for i in range(input_ids.size(0))]
        tree_lengths = [
            max(len(prompt_tokens[g]) - 1, 0) + sum(len(completion_tokens[i]) + 1 for i in members[g])
            for g in range(len(members))
        ]
        longest = max(tree_lengths, default=1)
        if max_tokens is not None:
            row_tokens = max(max_tokens, 1)
        elif coefficient is not None:
            row_tokens = choose_row_width(tree_lengths, coefficient, max_width=forward_tokens)
        else:
            row_tokens = longest
        plan = plan_micro_batches(tree_lengths, num_ranks=1, max_tokens=row_tokens)
        bins = [b for b in plan.micro_batches[0] if b]
        row_tokens = max(row_tokens, longest)
        rows_per_forward = len(bins) if forward_tokens is None else max(1, forward_tokens // row_tokens)

        forwards, order, owned = [], [], 0
        device = input_ids.device
        for start in range(0, len(bins), rows_per_forward):
            chunk = bins[start : start + rows_per_forward]
            width = max(sum(tree_lengths[g] for g in trees) for trees in chunk)
            ids = input_ids.new_zeros(len(chunk), width)
            positions = torch.zeros_like(ids)
            labels = torch.full_like(ids, -100)
            tree = torch.full_like(ids, -1)  # which tree a position belongs to (-1: filler)
            branch = torch.full_like(ids, -1)  # -1: the shared prompt; k: branch k of its tree
            for r, trees in enumerate(chunk):
                cursor = 0
                for g in trees:
                    prompt = prompt_tokens[g]
                    shared = max(len(prompt) - 1, 0)
                    ids[r, cursor : cursor + shared] = prompt[:shared]
                    positions[r, cursor : cursor + shared] = torch.arange(shared, device=device)
                    tree[r, cursor : cursor + shared] = g
                    cursor += shared
                    for k, row in enumerate(members[g]):
                        completion = completion_tokens[row]
                        n = len(completion) + 1
                        lead = prompt[-1:] if len(prompt) else completion.new_zeros(1)
                        ids[r, cursor : cursor + n] = torch.cat([lead, completion])
                        positions[r, cursor : cursor + n] = torch.arange(shared, shared + n, device=device)
                        labels[r, cursor + 1 : cursor + n] = completion
                        tree[r, cursor : cursor + n] = g
                        branch[r, cursor : cursor + n] = k
                        cursor += n
                        order.append(row)
                    owned += tree_lengths[g]
                # Filler: a tree of its own whose tokens see only themselves (positions from 0, never scored).
                tree[r, cursor:] = -2 - torch.arange(width - cursor, device=device)
                positions[r, cursor:] = 0
            causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
            same_tree = tree[:, :, None] == tree[:, None, :]
            visible_branch = (branch[:, None, :] == -1) | (branch[:, :, None] == branch[:, None, :])
            attend = causal[None] & same_tree & visible_branch
            forwards.append(TreeForward(ids, positions, labels, attend[:, None]))
        scored = mask[:, prompt_width:].clone()
        return cls(
            forwards=forwards,
            order=torch.tensor(order, dtype=torch.long, device=device),
            scored_grid=scored,
            lengths=mask.sum(dim=-1),
            processed_tokens=sum(f.input_ids.numel() for f in forwards),
            owned_tokens=owned,
        )

    def completion_values(self, per_forward: list[torch.Tensor]) -> torch.Tensor:
        values = torch.cat([out[f.scored] for out, f in zip(per_forward, self.forwards, strict=True)])
        return scatter_to_grid(values, self.scored_grid, self.order)


class PrefixTreePass:
    """The prefix-tree pass behind ``LogProbPass`` (see the module docstring).

    Args:
        agree_max: the largest of the ranks' values (forward counts under sharded parameters; ``passes.packed``).
        autocast: the trainer's autocast context.
        max_tokens: ``max_tokens_per_microbatch`` (None: rows as wide as the longest tree, or per ``coefficient``).
        coefficient: the model's ``attention_cost_coefficient``: rows of the cheapest width (``choose_row_width``).
        fallback: the pass for requests this one does not cover (image inputs, a router loss).
        one_forward_with_grad: run a pass with gradients as one forward (see ``passes.packed``).
        recompute: ``recompute_forwards``: recompute each forward in the backward (``forward_recompute``).
    """

    name = "prefix_tree"

    def __init__(
        self,
        fallback,
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
        self._fallback = fallback
        self._agree_max = agree_max
        self._autocast = autocast
        self._max_tokens = max_tokens

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Tree masks are dense 4D masks: sdpa and eager take them, flash-attention's varlen kernel does not."""
        return attention_implementation(model) in ("sdpa", "eager")

    def run(self, model: torch.nn.Module, request: PassRequest) -> PassResult:
        if request.has_extra_inputs:
            return self._fallback.run(model, request)
        ids, mask, keep = request.input_ids, request.attention_mask, request.logits_to_keep
        one_forward = self._one_forward_with_grad and torch.is_grad_enabled()
        forward_tokens = forward_token_limit(request.batch_size, ids.size(1), self._max_tokens, one_forward)
        rows = PrefixTreeRows.build(
            ids, mask, keep, max_tokens=self._max_tokens, forward_tokens=forward_tokens, coefficient=self._coefficient
        )
        eager = attention_implementation(model) == "eager"
        forwards = self._agree_max(len(rows.forwards))  # first: the ranks then agree on the recompute (passes.packed)
        recompute = recomputes(self._recompute, forwards)

        def forward_pass(input_ids, attention, position_ids, labels):
            with self._autocast():
                if eager:  # eager attention adds its mask to the scores
                    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
                    attention = torch.zeros(attention.shape, dtype=dtype, device=ids.device).masked_fill(
                        ~attention, torch.finfo(dtype).min
                    )
                outputs = model(
                    input_ids=input_ids,
                    attention_mask=attention,
                    position_ids=position_ids,
                    labels=labels,
                    fused_lm_head=True,
                    use_cache=False,
                )
            return outputs.log_probs, outputs.entropy if request.compute_entropy else None

        logps, entropies = [], []
        for forward in rows.forwards:
            log_probs, entropy = run_forward(
                forward_pass,
                forward.input_ids,
                forward.attention_mask,
                forward.position_ids,
                forward.labels,
                recompute=recompute,
            )
            logps.append(log_probs)
            entropies.append(entropy)
        result = rows.completion_values(logps)
        for _ in range(forwards - len(rows.forwards)):
            dummy = run_forward(partial(lockstep_dummy, model, autocast=self._autocast), ids, recompute=recompute)
            result = result + 0.0 * dummy
        duplicated = float(ids.numel())
        return PassResult(
            logps=result,
            entropies=rows.completion_values(entropies) if request.compute_entropy else None,
            aux_loss=None,
            row_lengths=rows.lengths.detach(),
            token_ratio=float(mask.sum()) / max(rows.owned_tokens, 1),
            chunk_token_ratios=[duplicated / max(rows.processed_tokens, 1)],
            processed_tokens=float(rows.processed_tokens),
            padding_tokens=float(rows.processed_tokens - rows.owned_tokens),
            forwards=len(rows.forwards),
            row_tokens=max(f.input_ids.size(1) for f in rows.forwards),
            recomputed_forwards=len(rows.forwards) if recompute else 0,
        )


def tree_is_cheaper(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_width: int,
    config,
    head_scores_every_position: bool,
) -> bool:
    """Whether the prefix tree costs fewer FLOPs than the shared-prefix pass (``shared_prefix``'s KV-cache pass) on
    this request, by a FLOP count of each: positions through the layers (2(4h^2 + 3hi) per layer), attention pairs
    (4h per layer; a tree's dense mask computes every pair of its row), and positions through the LM head (2hV).

    Where they differ: the shared-prefix pass runs each prompt's forward without the LM head (one position) but
    pads its prompt and suffix rows; the tree pads nothing but a row's slack, puts every position of the tree
    through the LM head where TRL's fused head scores every position (off Triton devices:
    ``head_scores_every_position``), and computes dense attention. Measured both ways (docs/benchmarks.md): the
    tree wins on long-tail completions with short prompts, the cache pass with long prompts and a large vocabulary."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h, layers, vocab = int(text.hidden_size), int(text.num_hidden_layers), int(text.vocab_size)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * h)
    per_position = layers * 2 * (4 * h * h + 3 * h * intermediate)
    per_pair = layers * 4 * h
    per_head_position = 2 * h * vocab

    rows, width = input_ids.shape
    prompt_width = width - completion_width
    mask = attention_mask.bool()
    groups = find_prompt_groups(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])
    prompt_lengths = mask[:, :prompt_width].sum(-1).index_select(0, groups.first_row)
    completion_lengths = mask[:, prompt_width:].sum(-1)
    tree_lengths = (prompt_lengths - 1).clamp(min=0).float()
    tree_lengths = tree_lengths.scatter_add(0, groups.row_group, (completion_lengths + 1).float())
    longest = float(tree_lengths.max()) if tree_lengths.numel() else 1.0
    tree_rows = math.ceil(float(tree_lengths.sum()) / max(longest, 1.0))
    tree_positions = tree_rows * longest
    tree = tree_positions * per_position + tree_rows * longest**2 * per_pair
    tree += (tree_positions if head_scores_every_position else float(completion_lengths.sum())) * per_head_position

    split = prompt_width - 1
    prefix_positions = groups.num_groups * split
    suffix_positions = rows * (width - split)
    shared = (prefix_positions + suffix_positions) * per_position
    shared += (groups.num_groups * split**2 + rows * (width - split) * width) * per_pair
    head = suffix_positions + groups.num_groups if head_scores_every_position else float(completion_lengths.sum())
    shared += head * per_head_position
    return tree < shared
