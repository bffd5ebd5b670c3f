"""Bytes of training state per parameter, measured by summing the tensors that hold it.

docs/optimizers.md gives the table; tests/test_master_weights.py checks it against this measurement.
"""

from __future__ import annotations

import torch


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is None or not isinstance(tensor, torch.Tensor):
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.numel())
        if key in seen:  # tied weights count once
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


def training_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes in model weights, their gradients, optimizer-held masters and optimizer moments (step counters excluded)."""
    params = list(model.parameters())
    optimizer_params = [p for group in optimizer.param_groups for p in group["params"]]
    model_ids = {id(p) for p in params}
    masters = [p for p in optimizer_params if id(p) not in model_ids]
    moments = [
        value
        for state in optimizer.state.values()
        for name, value in state.items()
        if name != "step" and isinstance(value, torch.Tensor)
    ]
    return {
        "weights": _nbytes(params),
        "gradients": _nbytes(p.grad for p in params),
        "masters": _nbytes(masters) + _nbytes(p.grad for p in masters),
        "moments": _nbytes(moments),
    }
