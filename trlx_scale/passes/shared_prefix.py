"""Shared-prefix log-prob pass: each distinct prompt of a batch goes through the model once, not once per completion.

A GRPO batch holds G completions per prompt, and TRL scores each row as prompt + completion, so the prompt is
processed G times in the old-policy, reference and loss passes. Here the rows are grouped by prompt and:

1. the unique prompts, without their last token, run once and leave their key/value states in a cache
   (``_CaptureLayer``);
2. each row's completion, preceded by the prompt's last token (whose hidden state predicts the first completion
   token), runs on top of its prompt's states (``_SharedPrefixLayer``, which gathers the unique states for the rows
   by index);
3. the backward of that gather sums the G rows' gradients into the shared states, so the prompt's gradient is the
   group's sum, as in the duplicated computation.

Positions, masks and the scored tokens are those of the duplicated forward (positions continue from the cached
length, as they do in the full row; the row's full attention mask covers both parts), so the log-probs and gradients
equal TRL's up to float rounding (tests/test_shared_prefix.py: 1e-5 relative in fp32, left padding, mixed prompt
lengths, LoRA, gradient checkpointing, G=1). Both caches are idempotent (capture overwrites, the completion cache only
reads), which is what lets them pass through gradient-checkpointed layers (``compat.checkpoint_with_cache``).

Sharded parameters: every rank must run the same forwards, so a chunk takes this pass only if every rank's chunk
can (``all_ranks_can_share``). The prompt's key/value states leave each decoder layer through the cache, not through
the layer's output, so their backward uses the layer's weights outside the window FSDP2 opens for the layer (its
pre-backward hook sits on the output; by then the completion's backward has resharded the layer). Under FSDP2 the
capture therefore hooks those states' gradients to re-gather the layer's weights first (``FSDPModule.unshard``);
FSDP2's post-backward then reduces the prompt's gradient and reshards. DeepSpeed ZeRO-3 hooks every submodule's
output (the key/value projections included), so it re-gathers by itself. Exact under both
(tests/test_shared_prefix_sharded.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..compat.checkpoint_with_cache import (
    checkpointed_cache_supported,
    keep_cache_under_checkpointing,
    uses_reentrant_checkpointing,
)
from .logprob_pass import PassRequest, PassResult


@dataclass(frozen=True)
class PromptGroups:
    """Rows of a batch grouped by identical prefix: ``first_row[g]`` represents group g, ``row_group[i]`` is row i's."""

    first_row: torch.Tensor
    row_group: torch.Tensor

    @property
    def num_groups(self) -> int:
        return int(self.first_row.numel())


def find_prompt_groups(prefix_ids: torch.Tensor, prefix_mask: torch.Tensor) -> PromptGroups:
    """Group rows whose (left-padded) prefixes hold the same tokens at the same places; groups in order of first row."""
    keyed = prefix_ids.masked_fill(prefix_mask == 0, -1)
    _, inverse = torch.unique(keyed, dim=0, return_inverse=True)
    rows = torch.arange(keyed.size(0), device=keyed.device)
    num_groups = int(inverse.max()) + 1 if rows.numel() else 0
    first = torch.full((num_groups,), keyed.size(0), dtype=torch.long, device=keyed.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    # Renumber groups by their first row so the grouping does not depend on torch.unique's sort order.
    order = torch.argsort(first)
    renumber = torch.empty_like(order)
    renumber[order] = torch.arange(num_groups, device=keyed.device)
    return PromptGroups(first_row=first[order], row_group=renumber[inverse])


class _CaptureLayer(DynamicLayer):
    """Keeps the key/value states of the prefix forward. Overwrites rather than appends, so a checkpoint recompute
    stores the same states again instead of doubling the cache. ``owner``: the decoder layer when FSDP2 shards it,
    whose weights the states' backward must re-gather (see the module's docstring)."""

    def __init__(self, owner: torch.nn.Module | None = None):
        super().__init__()
        self.owner = owner

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.owner is not None and key_states.requires_grad:
            owner = self.owner

            def regather(grad: torch.Tensor) -> torch.Tensor:
                owner.unshard()  # a no-op while the layer is still gathered
                return grad

            key_states.register_hook(regather)
            value_states.register_hook(regather)
        self.keys, self.values = key_states, value_states
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0  # read only before the layer runs: the prefix starts at position 0


class _SharedPrefixLayer(DynamicLayer):
    """Read-only: returns the rows' prefix states (gathered from the unique ones) followed by the new states."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, row_group: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.row_group = keys, values, row_group

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        # Gathered here, inside the layer, so only the unique states stay alive between forward and backward.
        keys = torch.cat([self.keys.index_select(0, self.row_group), key_states], dim=-2)
        values = torch.cat([self.values.index_select(0, self.row_group), value_states], dim=-2)
        return keys, values


def shared_token_ratio(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> float:
    """Token positions the duplicated pass processes over those the shared pass does (padded, as computed)."""
    rows, length = input_ids.shape
    split = length - logits_to_keep - 1
    if split < 1:
        return 1.0
    groups = find_prompt_groups(input_ids[:, :split], attention_mask[:, :split])
    return rows * length / (groups.num_groups * split + rows * (length - split))


def shared_positions_and_padding(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int
) -> tuple[float, float]:
    """Token positions the shared pass processes (each unique prompt once, padded; every row's suffix, padded) and
    how many of them are padding."""
    split = input_ids.size(1) - logits_to_keep - 1
    groups = find_prompt_groups(input_ids[:, :split], attention_mask[:, :split])
    prefix_mask = attention_mask[:, :split].index_select(0, groups.first_row)
    suffix_mask = attention_mask[:, split:]
    positions = prefix_mask.numel() + suffix_mask.numel()
    return float(positions), float(positions - prefix_mask.sum() - suffix_mask.sum())


def _fsdp2_layers(model: torch.nn.Module) -> list[torch.nn.Module | None]:
    """The decoder layers in order, each where FSDP2 shards it on its own (as Accelerate wraps them), else None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2's public API: nothing here is sharded by it
        return [None] * num_decoder_layers(model)

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    classes = set(getattr(base, "_no_split_modules", None) or ())
    # fully_shard swaps a module's class for a subclass (FSDP<Name>): match on the class's ancestry.
    layers = [m for m in model.modules() if any(c.__name__ in classes for c in type(m).__mro__)]
    if len(layers) != num_decoder_layers(model):
        return [None] * num_decoder_layers(model)
    return [m if isinstance(m, FSDPModule) else None for m in layers]


def num_decoder_layers(model: torch.nn.Module) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the shared-prefix pass cannot run exactly on ``model``, or None when it can."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "the model is encoder-decoder (the prompt is not a prefix of the decoder input)"
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text_config is not config:
        return "the model is multimodal (image tokens are not covered by the prompt grouping)"
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return f"the model has non-full-attention layers ({sorted(set(layer_types))}); only full attention is exact"
    if (
        layer_types is None
        and getattr(text_config, "sliding_window", None)
        and getattr(text_config, "use_sliding_window", True)
    ):
        return "the model uses sliding-window attention; only full attention is exact"
    if not getattr(model, "_supports_cache_class", True) or not hasattr(model, "get_output_embeddings"):
        return "the model does not take a transformers Cache"
    gradient_checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    if gradient_checkpointing and not checkpointed_cache_supported():
        return "gradient checkpointing drops the cache in this transformers version"
    if gradient_checkpointing and uses_reentrant_checkpointing(model):
        return (
            "gradient checkpointing is reentrant (use_reentrant=True), which cuts the gradient of the shared states; "
            "set gradient_checkpointing_kwargs={'use_reentrant': False}"
        )
    return None


def can_share_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> bool:
    """Whether the shared pass has anything to share in this chunk: a prompt of 2+ columns that two rows repeat.

    Under sharded parameters (ZeRO-3, FSDP2) every rank must run the same forwards, so the trainer takes the shared
    pass for a chunk only when this holds on every rank (``all_ranks_can_share``)."""
    prompt_length = input_ids.size(1) - logits_to_keep
    if prompt_length < 2:
        return False
    split = prompt_length - 1
    groups = find_prompt_groups(input_ids[:, :split], attention_mask[:, :split])
    return groups.num_groups < input_ids.size(0)


def all_ranks_can_share(local: bool, collective: bool, device: torch.device | str = "cpu") -> bool:
    """Whether every rank takes the shared pass for its current chunk.

    Under several processes (``collective``) all ranks must run the same forwards: under sharded parameters (ZeRO-3,
    FSDP2) each forward gathers the weights with collectives, and under DDP the reducer expects every rank's backward
    to follow the same forwards (a rank running the shared pass's two forwards beside one running a single forward
    hangs the all-reduce). So the shared pass runs only if every rank's chunk has a repeated prompt, else every rank
    takes the duplicated pass. One MAX all-reduce of one number per chunk ("some rank cannot"); none in a single
    process. ``device``: where the collective's tensor lives (the accelerator's device under NCCL)."""
    import torch.distributed as dist

    if not collective or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    blocked = torch.tensor([0.0 if local else 1.0], device=device)
    dist.all_reduce(blocked, op=dist.ReduceOp.MAX)
    return bool(blocked.item() == 0)


def shared_prefix_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    compute_entropy: bool = False,
    inner_model: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Per-token log-probs (and entropies) of the last ``logits_to_keep`` tokens, computed with shared prefixes.

    ``model`` must carry TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``), as GRPOTrainer's models do;
    ``inner_model`` is the unwrapped model whose layers and config are inspected (defaults to ``model``). The prompt
    is ``input_ids[:, :-logits_to_keep]`` (left-padded), the completion the rest. Returns None when no two rows share
    a prefix (or the prompt has a single column): then there is nothing to save and the caller runs the plain pass.
    """
    inner_model = model if inner_model is None else inner_model
    if not can_share_prefix(input_ids, attention_mask, logits_to_keep):
        return None
    split = input_ids.size(1) - logits_to_keep - 1  # the prompt's last token goes with the completion
    prefix_ids, prefix_mask = input_ids[:, :split], attention_mask[:, :split]
    groups = find_prompt_groups(prefix_ids, prefix_mask)

    owners = _fsdp2_layers(inner_model)
    capture = Cache(layers=[_CaptureLayer(owner) for owner in owners])
    with keep_cache_under_checkpointing(inner_model):
        # logits_to_keep=1: the prefix's own logits are never used, so the LM head runs on one position only.
        model(
            input_ids=prefix_ids.index_select(0, groups.first_row),
            attention_mask=prefix_mask.index_select(0, groups.first_row),
            past_key_values=capture,
            use_cache=False,
            logits_to_keep=1,
        )
        shared = Cache(
            layers=[_SharedPrefixLayer(layer.keys, layer.values, groups.row_group) for layer in capture.layers]
        )
        suffix_ids = input_ids[:, split:]
        labels = suffix_ids.masked_fill(attention_mask[:, split:] == 0, -100)
        labels[:, 0] = -100  # the prompt's last token is context, not scored
        outputs = model(
            input_ids=suffix_ids,
            attention_mask=attention_mask,
            past_key_values=shared,
            labels=labels,
            fused_lm_head=True,
        )
    logps = outputs.log_probs[:, -logits_to_keep:]
    entropies = outputs.entropy[:, -logits_to_keep:] if compute_entropy else None
    return logps, entropies


class SharedPrefixPass:
    """The shared-prefix pass behind the ``LogProbPass`` interface: chunk by chunk (TRL's ``batch_size`` rows at a
    time), each chunk's prompts shared where every rank can (``all_ranks_can_share``), the padded pass otherwise.

    Args:
        padded: the fallback pass (``PaddedPass``) for chunks without a repeated prompt.
        agree: the per-chunk decision agreed by every rank (``all_ranks_can_share`` bound to the trainer's layout).
        autocast: the trainer's autocast context (``accelerator.autocast``).
        inner_model: the unwrapped model (its layers and config are inspected).
    """

    name = "shared_prefix"

    def __init__(self, padded, agree: Callable[[bool], bool], autocast: Callable, inner_model: torch.nn.Module):
        self._padded = padded
        self._agree = agree
        self._autocast = autocast
        self._inner_model = inner_model

    def run(self, model: torch.nn.Module, request: PassRequest) -> PassResult:
        if request.has_extra_inputs:
            raise ValueError("the shared-prefix pass covers text rows without a router loss; use the padded pass.")
        rows, keep = request.input_ids.size(0), request.logits_to_keep
        batch_size = request.batch_size or rows
        all_logps, all_entropies, chunk_ratios = [], [], []
        rows_tokens = processed_tokens = shared_positions = shared_padding = 0.0
        fallbacks: list[PassResult] = []
        for start in range(0, rows, batch_size):
            chunk = request.rows(start, start + batch_size)
            ids, mask = chunk.input_ids, chunk.attention_mask
            shared = None
            if self._agree(can_share_prefix(ids, mask, keep)):
                with self._autocast():
                    shared = shared_prefix_logps(
                        model, ids, mask, keep, request.compute_entropy, inner_model=self._inner_model
                    )
            used = shared is not None
            if not used:
                result = self._padded.run(model, chunk)
                fallbacks.append(result)
                shared = (result.logps, result.entropies)
            # Tokens the padded pass would process over tokens this one did: how much the sharing pays.
            ratio = shared_token_ratio(ids, mask, keep) if used else 1.0
            if used:
                positions, padding = shared_positions_and_padding(ids, mask, keep)
                shared_positions += positions
                shared_padding += padding
            chunk_ratios.append(ratio)
            rows_tokens += float(mask.sum())
            processed_tokens += float(mask.sum()) / ratio
            all_logps.append(shared[0])
            all_entropies.append(shared[1])
        return PassResult(
            logps=torch.cat(all_logps),
            entropies=torch.cat(all_entropies) if request.compute_entropy else None,
            aux_loss=None,
            row_lengths=request.attention_mask.sum(dim=-1).detach(),
            token_ratio=rows_tokens / max(processed_tokens, 1.0),
            chunk_token_ratios=chunk_ratios,
            processed_tokens=float(sum(r.processed_tokens for r in fallbacks)) + shared_positions,
            padding_tokens=float(sum(r.padding_tokens for r in fallbacks)) + shared_padding,
            forwards=len(chunk_ratios),
            row_tokens=request.input_ids.size(1),
            recomputed_forwards=sum(r.recomputed_forwards for r in fallbacks),
        )
