"""What each role of a run holds on this rank, counted tensor by tensor: the measured side of the planner's roles.

A role's model states are its parameters (a DeepSpeed ZeRO-3 partition, an FSDP2 DTensor's local shard, or the whole
tensor), their gradients, and its optimizer's state: fp32 master copies (``FP32MasterAdamW``, DeepSpeed's flat fp32
partitions), DeepSpeed's gradient partitions, and the moments. Every tensor is counted once (by identity), so an
optimizer whose groups hold the module's own parameters adds only its moments. Tensors count wherever they live (an
optimizer offloaded to host memory counts too). Activations, buffers of collectives
and the allocator's cache are not model states and are not counted: on a GPU, ``memory/peak_device_gib`` is the whole
peak beside these.

Trainers log the result as ``memory/held/<role>_gib`` (``MemoryPlanner``): the held memory of the policy,
critic and reference under 1 process, DDP, ZeRO-3 or FSDP2 can be read off a run's logs, side by side with the
planner's per-GPU number.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .memory_model import GIB

# DeepSpeed optimizers' own flat buffers: fp32 master partitions (ZeRO-3, ZeRO-1/2, the bf16 optimizer) and the
# gradient partitions ZeRO keeps between backward and step.
_DEEPSPEED_BUFFERS = (
    "fp32_partitioned_groups_flat",
    "single_partition_of_fp32_groups",
    "fp32_groups_flat_partition",
    "grad_partitions_flat_buffer",
)


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor`` held on this rank: a ZeRO-3 parameter's partition, a DTensor's local shard, else all."""
    partition = getattr(tensor, "ds_tensor", None)
    if partition is not None:
        return partition.numel() * partition.element_size()
    if hasattr(tensor, "to_local"):  # torch.distributed.tensor.DTensor
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def _unwrap_optimizer(optimizer):
    """The optimizer under Accelerate's wrapper (and DeepSpeed's, which subclasses it)."""
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    optimizer = _unwrap_optimizer(optimizer)
    if optimizer is None:
        return
    for name in _DEEPSPEED_BUFFERS:
        yield from _tensors(getattr(optimizer, name, None))
    inner = getattr(optimizer, "optimizer", None)  # a DeepSpeed ZeRO optimizer wraps the torch one
    torch_optimizer = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
    if isinstance(torch_optimizer, torch.optim.Optimizer):
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                yield param  # FP32MasterAdamW's masters (a plain optimizer's are the module's: counted once)
                if param.grad is not None:
                    yield param.grad
        for state in torch_optimizer.state.values():
            yield from _tensors(state)


def held_bytes(module: torch.nn.Module, optimizer=None) -> int:
    """Bytes of model states this rank holds for one role: its module's parameters and gradients, and the state of
    its optimizer (Accelerate- or DeepSpeed-wrapped, or plain), each tensor once."""
    tensors: dict[int, torch.Tensor] = {}
    for param in module.parameters():
        tensors.setdefault(id(param), param)
        if param.grad is not None:
            tensors.setdefault(id(param.grad), param.grad)
    for tensor in _optimizer_tensors(optimizer):
        tensors.setdefault(id(tensor), tensor)
    return sum(local_bytes(t) for t in tensors.values() if t.device.type != "meta")


def held_gib(module: torch.nn.Module, optimizer=None) -> float:
    return held_bytes(module, optimizer) / GIB
