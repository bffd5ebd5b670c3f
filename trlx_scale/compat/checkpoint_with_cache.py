"""Keep a KV cache through transformers' gradient-checkpointed decoder layers.

Why: a transformers decoder layer under gradient checkpointing drops ``past_key_values`` (a cache that is written in
the forward would be written a second time by the backward recompute), unless the layer says it only reads the
cache: ``GradientCheckpointingLayer._can_checkpoint_with_cache``. The shared-prefix pass (``passes.shared_prefix``)
passes caches whose ``update`` is idempotent (the prefix capture overwrites, the completion cache only reads), so a
recompute sees exactly the states of the forward. While that pass runs, this module sets the documented flag on the
instances of the model's layers, and removes it afterwards; the classes are never touched. The layers capture their
keyword arguments at call time, so the backward recompute (after the context has exited) still gets the cache.

It needs non-reentrant checkpointing (transformers' default): reentrant checkpointing runs the forward without
autograd, so the key/value states leaving a layer through the cache would carry no gradient.

Covered: transformers 5.x with ``_can_checkpoint_with_cache`` (checked: 5.19). ``tests/test_compat.py`` fails when
the attribute disappears or ``GradientCheckpointingLayer.__call__`` stops consulting it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch

FLAG = "_can_checkpoint_with_cache"


def checkpointed_cache_supported() -> bool:
    """Whether this transformers lets a layer keep a read-only cache under gradient checkpointing."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return False
    return hasattr(GradientCheckpointingLayer, FLAG) and FLAG in inspect.getsource(GradientCheckpointingLayer.__call__)


def uses_reentrant_checkpointing(model: torch.nn.Module) -> bool:
    """Whether any checkpointed layer of ``model`` runs ``torch.utils.checkpoint`` in reentrant mode."""
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if getattr(module, "gradient_checkpointing", False) and func is not None:
            keywords = getattr(func, "keywords", {}) or {}
            if keywords.get("use_reentrant", True):
                return True
    return False


@contextmanager
def keep_cache_under_checkpointing(model: torch.nn.Module) -> Iterator[None]:
    """Let ``model``'s checkpointed layers keep the (idempotent) cache passed to them while the block runs."""
    if not any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        yield
        return
    if not checkpointed_cache_supported():
        raise RuntimeError(
            f"This transformers version has no `{FLAG}` on GradientCheckpointingLayer, so a cache cannot pass "
            "through checkpointed layers: set shared_prefix='false' or gradient_checkpointing=False."
        )
    from transformers.modeling_layers import GradientCheckpointingLayer

    flagged = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and FLAG not in vars(m)]
    for module in flagged:
        setattr(module, FLAG, True)
    try:
        yield
    finally:
        for module in flagged:
            delattr(module, FLAG)
