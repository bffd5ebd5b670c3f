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

FSDP2: parameters are DTensors, each rank holding a shard. ``gathered_full_weights`` and ``gathered_adapter``
gather them one tensor at a time (``full_tensor``, a collective: every rank calls them, in the same order) and only
the writing rank keeps the result. A merged LoRA layer is computed from the gathered base weight and adapter
(``merged_lora_weight``): PEFT's ``merge_adapter`` would add a sharded delta into a sharded weight in place, and the
rank that writes needs the whole merged tensor anyway.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from ..compat.vllm_weight_reload import tied_weight_aliases
from ..weight_fingerprints import FINGERPRINTS_FILE, fingerprint
from .weight_sync import ram_backed_directory, unsharded, write_adapter_config

WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's name for the weights save_pretrained writes


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


def checkpoint_name(name: str, peft: bool) -> str | None:
    """A base model's state-dict key under the name vLLM loads (None: an adapter tensor, not part of the model)."""
    if not peft:
        return name
    if "lora_" in name or ".original_module." in name:
        return None
    return name.replace(".base_layer", "").replace(".modules_to_save.default", "")


def _with_aliases(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    for source, alias in tied_weight_aliases(model).items():
        tensors[alias] = tensors[source].clone()  # safetensors stores no shared storage
    return tensors


def save_full_weights(tensors: dict[str, torch.Tensor], directory: str, dtype: torch.dtype | None = None) -> str:
    """``tensors`` as ``directory/model.safetensors``, written atomically; floating-point ones in ``dtype`` when
    given: the server's (fp32 master weights sent to a bf16 server would be files twice the size it loads). Beside
    them each tensor's fingerprint as written (``weight_fingerprints``), which the server's reload is checked
    against."""
    if dtype is not None:
        tensors = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(os.path.abspath(directory)))
    save_file(tensors, os.path.join(staging, WEIGHTS_FILE))
    with open(os.path.join(staging, FINGERPRINTS_FILE), "w") as handle:
        json.dump({name: fingerprint(tensor) for name, tensor in tensors.items()}, handle)
    return _publish(staging, directory)


def write_full_weights(model: torch.nn.Module, directory: str, dtype: torch.dtype | None = None) -> str:
    """Every weight of ``model`` (tied aliases named too) as ``directory/model.safetensors``, written atomically,
    in ``dtype`` if given (``save_full_weights``). A PEFT model is written as its base with whatever is merged into
    it (``merge_adapter`` first). Not for FSDP2 (``gathered_full_weights``)."""
    peft = hasattr(model, "get_base_model")
    base = model.get_base_model() if peft else model
    tensors = {}
    for name, parameter in base.state_dict().items():
        # A merged PEFT model: its layers' own weights, under the checkpoint's names.
        name = checkpoint_name(name, peft)
        if name is not None:
            tensors[name] = parameter.detach().to("cpu").contiguous()
    return save_full_weights(_with_aliases(tensors, base), directory, dtype)


def _adapter_layers(base: torch.nn.Module, adapter: str) -> dict[str, torch.nn.Module]:
    """``{state-dict key of the base weight: layer}`` for every PEFT tuner layer holding ``adapter``. Raises, before
    any collective (every rank raises alike), unless each is a plain LoRA ``Linear``: the merge below is
    W + scaling * B @ A, which DoRA and the other LoRA variants, ``lora_bias`` and LoRA on embeddings are not."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = {}
    for name, module in base.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        holds = any(adapter in getattr(module, attr, {}) for attr in module.adapter_layer_names)
        if not holds:
            continue
        plain = (
            isinstance(module, LoraLinear)
            and adapter not in module.lora_variant
            and not module.use_dora.get(adapter)
            and not module.lora_bias.get(adapter)
        )
        if not plain:
            raise ValueError(
                f"{name} ({type(module).__name__}, adapter {adapter!r}) is not plain LoRA on a linear layer: under "
                "FSDP2 the asynchronous trainer sends a LoRA policy merged from gathered tensors, which it computes "
                "for plain LoRA Linear layers only (no DoRA or other variant, no lora_bias, no LoRA on embeddings "
                "or the LM head). Use plain LoRA on linear layers (vllm_sync_mode='lora' sends it as an adapter), "
                "or train this adapter under ZeRO-3 or DDP."
            )
        layers[f"{name}.base_layer.weight"] = module
    return layers


def merged_lora_weight(layer: torch.nn.Module, adapter: str, keep: bool) -> torch.Tensor | None:
    """The whole weight of a plain LoRA ``Linear`` with ``adapter`` merged (W + scaling * B @ A, as PEFT's
    ``get_delta_weight``). Every rank gathers (collectives under FSDP2); the ranks with ``keep`` compute it."""
    weight = unsharded(layer.base_layer.weight.detach())
    lora_a = unsharded(layer.lora_A[adapter].weight.detach())
    lora_b = unsharded(layer.lora_B[adapter].weight.detach())
    if not keep:
        return None
    delta = (lora_b.float() @ lora_a.float()) * layer.scaling[adapter]
    if layer.fan_in_fan_out:
        delta = delta.T
    return (weight.float() + delta).to(weight.dtype)


def gathered_full_weights(model: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """``write_full_weights``'s tensors from an FSDP2-sharded model (a PEFT one with its active adapter merged):
    every rank calls it; the ranks with ``keep`` get the tensors, the others an empty dict. Each tensor is gathered
    once: a tied alias is a copy of its source, made where kept."""
    peft = hasattr(model, "get_base_model")
    base = model.get_base_model() if peft else model
    adapter = model.active_adapter if peft else None
    merged_layers = _adapter_layers(base, adapter) if peft else {}
    aliases = set(tied_weight_aliases(base).values())
    tensors = {}
    for name, parameter in base.state_dict().items():
        target = checkpoint_name(name, peft)
        if target is None or target in aliases:
            continue
        layer = merged_layers.get(name)
        if layer is not None:
            tensor = merged_lora_weight(layer, adapter, keep)
        else:
            tensor = unsharded(parameter.detach())
        if keep:
            tensors[target] = tensor.to("cpu").contiguous()
    return _with_aliases(tensors, base) if keep else {}


def write_adapter(model: torch.nn.Module, directory: str) -> str:
    """A PEFT model's adapter (``save_pretrained``: config and weights) in ``directory``, written atomically."""
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(os.path.abspath(directory)))
    model.save_pretrained(staging)
    return _publish(staging, directory)


def gathered_adapter(model: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """The active adapter's tensors of an FSDP2-sharded PEFT model, gathered (every rank calls it; the ranks with
    ``keep`` get them)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=model.active_adapter)
    tensors = {name: unsharded(tensor.detach()) for name, tensor in state.items()}
    return {name: tensor.to("cpu").contiguous() for name, tensor in tensors.items()} if keep else {}


def save_adapter(model: torch.nn.Module, tensors: dict[str, torch.Tensor], directory: str) -> str:
    """``save_pretrained``'s files for gathered adapter ``tensors`` (``gathered_adapter``), written atomically."""
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(os.path.abspath(directory)))
    write_adapter_config(os.path.join(staging, "adapter_config.json"), model, model.active_adapter)
    save_file(tensors, os.path.join(staging, ADAPTER_FILE), metadata={"format": "pt"})
    return _publish(staging, directory)


def remove_version(directory: str) -> None:
    """Delete a version's files once no server can still load them."""
    shutil.rmtree(directory, ignore_errors=True)
