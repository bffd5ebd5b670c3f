"""Is the policy's frozen base still the checkpoint that vLLM loads?

LoRA-only sync sends the adapter and nothing else: the engine keeps the base weights it loaded from the model's
files. If the base in memory differs from those files (an initialisation that rewrites it, as PiSSA, OLoRA, LoftQ
and CorDA do, or any in-place edit before training), the engine samples from a different model than the one being
trained, silently. This module tells, once at engine start-up, so that the sync falls back to merged weights.
"""

from __future__ import annotations

import json
import os

import torch

# PEFT initialisations that replace base weights by a residual (or a quantized copy) when the adapter is created.
BASE_REWRITING_INITS = ("pissa", "olora", "loftq", "corda")
# Elements compared per tensor: a strided sample, enough to catch any real edit, cheap for 70B models.
SAMPLED_ELEMENTS = 4096


def base_rewriting_init(config) -> str | None:
    """The adapter's initialisation if it rewrites the base weights, else None."""
    init = getattr(config, "init_lora_weights", True)
    if isinstance(init, str) and init.lower().split("_")[0] in BASE_REWRITING_INITS:
        return init
    if getattr(config, "loftq_config", None):
        return "loftq"
    return None


def _checkpoint_files(name_or_path: str) -> list[str]:
    """The safetensors files of a local checkpoint directory (empty when there is none to compare with)."""
    if not os.path.isdir(name_or_path):
        try:
            from huggingface_hub import snapshot_download

            name_or_path = snapshot_download(name_or_path, local_files_only=True, allow_patterns=["*.safetensors*"])
        except Exception:  # noqa: BLE001 - not in the local cache: nothing to compare with
            return []
    index = os.path.join(name_or_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as handle:
            names = sorted(set(json.load(handle)["weight_map"].values()))
        return [os.path.join(name_or_path, name) for name in names]
    single = os.path.join(name_or_path, "model.safetensors")
    return [single] if os.path.isfile(single) else []


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    step = max(1, flat.numel() // SAMPLED_ELEMENTS)
    return flat[::step][:SAMPLED_ELEMENTS]


def base_differs_from_checkpoint(peft_model: torch.nn.Module) -> str | None:
    """Why the in-memory base of ``peft_model`` is not its checkpoint's (the first tensor that differs), or None when
    every base tensor matches (a strided sample of each, compared in the model's dtype) or there are no local files."""
    from safetensors import safe_open

    base = peft_model.get_base_model()
    files = _checkpoint_files(str(getattr(base, "name_or_path", "") or ""))
    if not files:
        return None
    params = {name.replace(".base_layer", ""): p for name, p in base.named_parameters() if "lora_" not in name}
    for path in files:
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                param = params.get(key)
                if param is None or tuple(handle.get_slice(key).get_shape()) != tuple(param.shape):
                    continue
                stored = _sample(handle.get_tensor(key)).to(param.dtype)
                current = _sample(param.detach()).to("cpu")
                if not torch.equal(stored, current):
                    return f"the base weight {key} differs from the checkpoint's ({os.path.basename(path)})"
    return None
