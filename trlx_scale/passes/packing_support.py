"""Whether a model can run padding-free packed rows exactly: a static gate, then a check on the model itself.

Packed rows rely on the attention giving each sample a block of its own from ``position_ids`` alone (no attention
mask, no cache; ``packed_rows``). That holds for:

- ``sdpa`` and ``eager`` (transformers builds the block-diagonal mask from the positions), CPU and GPU;
- flash-attention 2/3 (its varlen kernel reads the sequence starts from the positions), GPU.

It does not hold for ``flex_attention`` on CPU (no backward there), for recurrent or convolutional layers (a state
carried across tokens crosses sample boundaries), for encoder-decoders and multimodal inputs (not a text row), nor for
a model whose attention ignores ``position_ids``. The static gate (``packing_unsupported_reason``) names the first
two kinds from the config; ``check_packing_isolated`` catches any other by running two packed samples and changing
one: the other's log-probs must not move.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PACKABLE_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
# layer_types that carry a state across tokens, or attend outside the sample's causal window by design.
_UNPACKABLE_LAYER_TYPES = ("linear_attention", "mamba", "conv", "recurrent", "short_conv", "chunked_attention")


def attention_implementation(model: torch.nn.Module) -> str:
    """The model's attention implementation, through a DDP wrapper or a DeepSpeed engine (their ``module``)."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return str(getattr(config, "_attn_implementation", None) or getattr(model.config, "_attn_implementation", "eager"))


def packing_unsupported_reason(model: torch.nn.Module, device_type: str) -> str | None:
    """Why packed rows would not be exact on ``model`` (on ``device_type``), or None when the static checks pass."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "the model is encoder-decoder (a packed row is a decoder-only layout)"
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text_config is not config:
        return "the model is multimodal (image inputs are laid out per padded row)"
    implementation = attention_implementation(model)
    if implementation.startswith("flash_attention") and device_type == "cpu":
        return f"attn_implementation={implementation!r} needs a GPU; use 'sdpa' on CPU"
    if implementation not in PACKABLE_ATTENTION and "flash" not in implementation:
        hint = " (flex_attention has no backward on CPU)" if implementation == "flex_attention" else ""
        return (
            f"attn_implementation={implementation!r} is not known to isolate packed samples{hint}; use one of "
            f"{PACKABLE_ATTENTION}"
        )
    layer_types = getattr(text_config, "layer_types", None) or ()
    stateful = sorted({t for t in layer_types if any(kind in t for kind in _UNPACKABLE_LAYER_TYPES)})
    if stateful:
        return f"the model has {stateful} layers, whose state would cross sample boundaries in a packed row"
    return None


def check_packing_isolated(
    model: torch.nn.Module, vocab_size: int, device: torch.device, autocast: Callable
) -> str | None:
    """Run two samples packed in one row, then the same with the first one's tokens changed: the second one's
    log-probs must not move (they move by ~0.5 when samples attend to each other). Returns the failure, or None.

    Every rank must call it together under sharded parameters (it runs two forwards)."""
    first = torch.arange(3, 9, device=device) % vocab_size
    changed = (first * 7 + 5) % vocab_size
    second = (torch.arange(11, 16, device=device) * 3) % vocab_size
    positions = torch.cat([torch.arange(first.numel()), torch.arange(second.numel())]).to(device).unsqueeze(0)
    labels = torch.cat([torch.full_like(first, -100), second]).unsqueeze(0)
    labels[0, first.numel()] = -100  # the second sample's first token has nothing of its own before it
    outputs = []
    with torch.no_grad(), autocast():
        for head in (first, changed):
            ids = torch.cat([head, second]).unsqueeze(0)
            out = model(input_ids=ids, position_ids=positions, labels=labels, fused_lm_head=True, use_cache=False)
            outputs.append(out.log_probs[labels[:, 1:] != -100].float())
    moved = (outputs[0] - outputs[1]).abs().max().item()
    if moved > 1e-4:
        return (
            f"in a packed row a sample's log-probs moved by {moved:.3g} when another sample changed: this model's "
            f"attention ({attention_implementation(model)}) does not keep packed samples apart"
        )
    return None
