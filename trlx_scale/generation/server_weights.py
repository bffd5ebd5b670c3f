"""The files a vLLM server loads a policy version from: an adapter directory (LoRA) or a safetensors file (full
weights), each written atomically, in shared memory when it has room.

A server in another process cannot take tensors from the trainer's memory on CPU (vLLM 0.32's weight-transfer
engines are NCCL/IPC kinds, CUDA only), so each version goes through files: ``/dev/shm`` (RAM, no disk write) when it
holds twice the version's size, else the system's temporary directory. A version's directory is written under a
temporary name and renamed, so a server never reads a half-written version.

Tied weights: a transformers model with tied input/output embeddings saves the shared tensor once, while vLLM keeps
``lm_head`` as a layer of its own and its reload leaves a layer without weights in the files untouched (the served
log-probs then come from the new body and the old head). The full-weight file therefore names every alias
(``compat.vllm_weight_reload.tied_weight_aliases``), as the colocated sync streams them.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from ..compat.vllm_weight_reload import tied_weight_aliases
from .weight_sync import ram_backed_directory

WEIGHTS_FILE = "model.safetensors"


def version_root(size_bytes: int, root: str | None = None) -> str:
    """Where version directories go: a new directory under ``root`` if given, else in shared memory when it has
    twice ``size_bytes`` free, else on disk (``weight_sync.ram_backed_directory``, the colocated sync's rule)."""
    if root is not None:
        return tempfile.mkdtemp(prefix="trlx-scale-policy-", dir=root)
    return ram_backed_directory(prefix="trlx-scale-policy-", needed_bytes=size_bytes)


def _publish(staging: str, final: str) -> str:
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(staging, final)
    return final


def write_full_weights(model: torch.nn.Module, directory: str) -> str:
    """Every weight of ``model`` (tied aliases named too) as ``directory/model.safetensors``, written atomically.
    A PEFT model is written as its base with whatever is merged into it (``merge_adapter`` first)."""
    peft = hasattr(model, "get_base_model")
    base = model.get_base_model() if peft else model
    aliases = tied_weight_aliases(base)
    tensors = {}
    for name, parameter in base.state_dict().items():
        if peft:  # a merged PEFT model: its layers' own weights, under the checkpoint's names
            if "lora_" in name or ".original_module." in name:
                continue
            name = name.replace(".base_layer", "").replace(".modules_to_save.default", "")
        tensors[name] = parameter.detach().to("cpu").contiguous()
    for source, alias in aliases.items():
        tensors[alias] = tensors[source].clone()  # safetensors stores no shared storage
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(os.path.abspath(directory)))
    save_file(tensors, os.path.join(staging, WEIGHTS_FILE))
    return _publish(staging, directory)


def write_adapter(model: torch.nn.Module, directory: str) -> str:
    """A PEFT model's adapter (``save_pretrained``: config and weights) in ``directory``, written atomically."""
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(os.path.abspath(directory)))
    model.save_pretrained(staging)
    return _publish(staging, directory)


def remove_version(directory: str) -> None:
    """Delete a version's files once no server can still load them."""
    shutil.rmtree(directory, ignore_errors=True)
