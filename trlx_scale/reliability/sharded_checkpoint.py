"""Per-rank sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), written synchronously or in the
background, readable at another world size.

With ``fsdp_state_dict_type: FULL_STATE_DICT`` every save gathers the whole model and optimizer on rank 0 (at 70B:
140 GB of bf16 weights plus 840 GB of fp32 masters and moments through one host) while every rank waits. Here each
rank writes only its own shards:

- the layout is Accelerate's own for ``SHARDED_STATE_DICT`` (``pytorch_model_fsdp_0/`` holding ``{"model": ...}``
  and ``optimizer_0/`` holding ``{"optimizer": ...}``, DCP format), so transformers' resume path
  (``load_fsdp_model``/``load_fsdp_optimizer``) reads a checkpoint written here, and this module reads Accelerate's;
- ``asynchronous=True`` works as ``dcp.async_save`` does (DCP's own stager, then ``dcp.save`` in a background thread on
  a gloo group of its own), with the model's and the optimizer's parts in one job: the call returns once the shards
  are staged (copied to host memory), the files are written while training goes on; ``PendingShardedSave.done()`` says when this
  rank's shards are durable, and the completion marker (``checkpoints.py``) is written only once every rank's are,
  so a process killed mid-write leaves a directory without a marker, which resume skips;
- DCP records each shard's place in the global tensor, so ``load_sharded`` reshards on load: a checkpoint of 2 ranks
  loads into 1, or 1 into 2 (tests/test_sharded_checkpoint.py; the planner's ``dedup`` writes a replicated tensor
  once).

The consolidated weights (one safetensors file a Hub user or vLLM loads) are written only where they are needed:
``consolidated_model_state`` gathers them for ``save_model`` and the Hub push, never for a training checkpoint.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

MODEL_DIR = "pytorch_model_fsdp_0"  # accelerate.utils.constants.FSDP_MODEL_NAME + "_0" (pinned by a contract test)
OPTIMIZER_DIR = "optimizer_0"  # accelerate.utils.constants.OPTIMIZER_NAME + "_0"


def uses_sharded_fsdp_checkpoints(trainer: Any) -> bool:
    """Whether a trainer's checkpoints are FSDP shards (Accelerate's ``fsdp_state_dict_type: SHARDED_STATE_DICT``)."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return bool(trainer.is_fsdp_enabled) and plugin is not None and "SHARDED" in str(plugin.state_dict_type)


def _options(full: bool = False, trained_only: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full, ignore_frozen_params=trained_only)


def _adapter_only(model: torch.nn.Module, adapter_only: bool) -> bool:
    return adapter_only and hasattr(model, "peft_config")


def sharded_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, adapter_only: bool = False
) -> dict[str, dict]:
    """This rank's part of the model's (and optimizer's) state: DTensor shards under FSDP2, plain tensors otherwise,
    keyed by fully qualified parameter names (so the optimizer's state is independent of parameter order).
    ``adapter_only``: a PEFT model's adapter only, under PEFT's names, as Accelerate saves it (transformers asks it to
    for every FSDP checkpoint, and reads it back the same way)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if _adapter_only(model, adapter_only):
        from peft import get_peft_model_state_dict

        weights = get_peft_model_state_dict(model, adapter_name=model.active_adapter)
    else:
        weights = get_model_state_dict(model, options=_options())
    state = {MODEL_DIR: {"model": weights}}
    if optimizer is not None:
        state[OPTIMIZER_DIR] = {"optimizer": get_optimizer_state_dict(model, optimizer, options=_options())}
    return state


@dataclass
class PendingShardedSave:
    """The writes of one save on this rank. ``blocking_s``: how long the caller was held (the whole write when
    synchronous; the staging copy when asynchronous)."""

    directory: str
    futures: list[Any] = field(default_factory=list)
    blocking_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def done(self) -> bool:
        return all(future.done() for future in self.futures)

    def wait(self) -> float:
        """Block until this rank's shards are durable (re-raising a failed write); the seconds since the save began."""
        for future in self.futures:
            future.result()
        return time.perf_counter() - self.started


_BACKGROUND_GROUP = None
_BACKGROUND_WRITER = None


def _background_writer():
    """The one thread that writes asynchronous saves, in the order they were made."""
    global _BACKGROUND_WRITER
    from concurrent.futures import ThreadPoolExecutor

    if _BACKGROUND_WRITER is None:
        _BACKGROUND_WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trlx-scale-checkpoint")
    return _BACKGROUND_WRITER


def _background_group():
    """A gloo group of its own for the background writer's collectives: they must not interleave with training's on
    the default group (NCCL on GPUs, which async_save cannot use anyway). Created on the first asynchronous save,
    which every rank reaches in the same order."""
    global _BACKGROUND_GROUP
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _BACKGROUND_GROUP is None:
        _BACKGROUND_GROUP = dist.new_group(backend="gloo")
    return _BACKGROUND_GROUP


def save_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    checkpoint_dir: str,
    asynchronous: bool = False,
    storage_writer_cls: type | None = None,
    adapter_only: bool = False,
) -> PendingShardedSave:
    """Write this rank's shards into ``checkpoint_dir`` (every rank calls it: DCP plans the save collectively).
    ``storage_writer_cls``: DCP's ``FileSystemWriter`` unless given (tests slow it down to kill a save mid-write)."""
    import torch.distributed.checkpoint as dcp

    writer_cls = storage_writer_cls or dcp.FileSystemWriter
    pending = PendingShardedSave(checkpoint_dir)
    parts = sharded_state(model, optimizer, adapter_only)
    for name in parts:
        os.makedirs(os.path.join(checkpoint_dir, name), exist_ok=True)
    if not asynchronous:
        for name, state in parts.items():
            dcp.save(state, storage_writer=writer_cls(os.path.join(checkpoint_dir, name)))
        pending.blocking_s = time.perf_counter() - pending.started
        return pending
    # Staged (copied to host memory) now, so training may change the weights; written by one background thread, the
    # model's then the optimizer's (two writers at once would run their collectives on one group in either order
    # on different ranks, and hang), and every save after the previous one.
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # Plain, synchronous copies, of both parts in one call: torch 2.11's stager empties its table of copiers after
    # each stage, so a second stage on the same stager fails at the first dict (KeyError: <class 'type'>), as
    # tests/gpu/test_sharded_checkpoint_gpu.py did on an H100.
    stager = DefaultStager(StagingOptions(False, False, False, False))
    staged = stager.stage(parts)
    stager.close()
    group = _background_group()

    def write() -> None:
        for name, state in staged.items():
            dcp.save(state, storage_writer=writer_cls(os.path.join(checkpoint_dir, name)), process_group=group)

    pending.futures.append(_background_writer().submit(write))
    pending.blocking_s = time.perf_counter() - pending.started
    return pending


def load_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    checkpoint_dir: str,
    adapter_only: bool = False,
) -> None:
    """Load a sharded checkpoint into ``model`` (and ``optimizer``) at this run's world size, whatever the saving
    run's was: each rank reads the pieces of every shard its own part overlaps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = sharded_state(model, optimizer, adapter_only)
    for name, part in state.items():
        dcp.load(part, storage_reader=dcp.FileSystemReader(os.path.join(checkpoint_dir, name)))
    if _adapter_only(model, adapter_only):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, state[MODEL_DIR]["model"], adapter_name=model.active_adapter)
    else:
        set_model_state_dict(model, state[MODEL_DIR]["model"], options=_options())
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state[OPTIMIZER_DIR]["optimizer"], options=_options())


def consolidated_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights in host memory, on rank 0 (every rank calls it; the others get an empty dict): for
    ``save_model``, the Hub and vLLM, which load one consolidated file."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    # A PEFT model saves its adapter only: gathering the frozen base (140 GB at 70B) to rank 0 would be for nothing.
    return get_model_state_dict(model, options=_options(full=True, trained_only=hasattr(model, "peft_config")))
