"""How a policy version's weights travel to vLLM servers: the transports behind ``ServerGeneration.ensure_version``.

The server engine decides *when* a version is sent, verified and published; a transport decides *how it travels*.
Every transport's ``deliver`` runs on every rank (gathering a sharded model is a collective); the main process alone
talks to the servers. Three transports:

- ``AdapterFilesTransport`` (LoRA policies synced as adapters): the adapter alone is gathered (under ZeRO-3 and
  FSDP2 too: ``sync/gathered_bytes`` is the adapter's size), written to a directory of its own and loaded under the
  version's own name (``/v1/load_lora_adapter``), so requests name their version and nothing is paused.
- ``FullWeightFilesTransport`` (full fine-tuning, or a LoRA policy merged): every weight is written as a safetensors
  file (``server_weights``) and each server reloads it in place (``/pause``, ``/collective_rpc reload_weights``,
  ``/resume``).
- ``NCCLWeightTransport``: vLLM 0.32's weight transfer (``/init_weight_transfer_engine``, ``/update_weights``,
  through vLLM's own ``NCCLTrainerWeightTransferEngine``): the main process broadcasts the full weights from GPU
  memory to the server's workers, no files. It needs CUDA on the trainer and the server (refused by name elsewhere)
  and has not run in this project's tests until a GPU run says otherwise (``tests/gpu/``).

Files go to shared memory when it has room (``server_weights.version_root``); a version's files are removed once no
group can ask for it (``release``) and at the end (``close``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from trl.distributed import DistributedBackend

from ..peft_models import is_peft_model
from . import server_weights
from .server_client import VLLMServerClient
from .weight_sync import adapter_parameters, is_fsdp2_sharded, partitioned_bytes

WEIGHT_TRANSFERS = ("files", "nccl")


@dataclasses.dataclass
class Delivery:
    """What one delivery cost: the seconds the servers were paused, and the bytes every rank gathered (None: not
    measured, an FSDP2 gather tensor by tensor)."""

    paused_seconds: float = 0.0
    gathered_bytes: float | None = None


class ServerWeightTransport(Protocol):
    """Delivers policy versions to every server (see the module docstring)."""

    name: str

    def deliver(self, model: torch.nn.Module, version: int) -> Delivery:
        """Send ``version``'s weights (every rank calls it; the main process talks to the servers)."""

    def release(self, version: int) -> None:
        """No group can ask for ``version`` any more: free what it holds (its files)."""

    def close(self) -> None:
        """The run is over: free everything."""


class _VersionFiles:
    """The directories of the versions written and not yet released (the main process's)."""

    def __init__(self, weights_root: str | None = None):
        self._root = weights_root
        self.directories: dict[int, str] = {}

    def directory(self, version: int, size_bytes: int) -> str:
        if self._root is None:
            self._root = server_weights.version_root(size_bytes)
        return f"{self._root}/v{version}"

    def release(self, version: int) -> None:
        path = self.directories.pop(version, None)
        if path is not None:
            server_weights.remove_version(path)

    def close(self) -> None:
        for version in list(self.directories):
            self.release(version)


def _model_bytes(model: torch.nn.Module, dtype: torch.dtype | None) -> int:
    """The size of a version's files: every parameter (ZeRO-3 partitions report it in ds_numel, DTensors in numel),
    in the servers' dtype when known."""
    size = None if dtype is None else dtype.itemsize
    return sum(getattr(p, "ds_numel", p.numel()) * (size or p.element_size()) for p in model.parameters())


class AdapterFilesTransport:
    """A LoRA adapter per version, loaded under the version's own name (see the module docstring)."""

    name = "adapter_files"

    def __init__(self, accelerator: Any, client: VLLMServerClient, weights_root: str | None = None):
        self.accelerator = accelerator
        self.client = client
        self.files = _VersionFiles(weights_root)
        self._backend = DistributedBackend(accelerator)

    def deliver(self, model: torch.nn.Module, version: int) -> Delivery:
        main = self.accelerator.is_main_process
        delivery = Delivery()
        if is_fsdp2_sharded(model):
            with torch.no_grad():
                tensors = server_weights.gathered_adapter(model, keep=main)
            if main:
                path = self.files.directory(version, _model_bytes(model, None))
                self.files.directories[version] = server_weights.save_adapter(model, tensors, path)
        else:
            # The adapter alone: under ZeRO-3 gathering the whole model on every rank at once is what runs out of
            # memory at the 30B and 70B recipes' sizes.
            gathered = adapter_parameters(model)
            delivery.gathered_bytes = float(partitioned_bytes(gathered))
            with torch.no_grad(), self._backend.gather_params(gathered):
                if main:
                    path = self.files.directory(version, _model_bytes(model, None))
                    self.files.directories[version] = server_weights.write_adapter(model, path)
        if main:
            self.client.load_adapter(version, self.files.directories[version])
        return delivery

    def release(self, version: int) -> None:
        self.files.release(version)

    def close(self) -> None:
        self.files.close()


class FullWeightFilesTransport:
    """Every weight (a LoRA policy merged) as a file each server reloads in place (see the module docstring)."""

    name = "full_weight_files"

    def __init__(
        self,
        accelerator: Any,
        client: VLLMServerClient,
        weights_dtype: torch.dtype | None = None,
        weights_root: str | None = None,
    ):
        self.accelerator = accelerator
        self.client = client
        self.weights_dtype = weights_dtype  # the servers' dtype: the files are written in it
        self.files = _VersionFiles(weights_root)
        self._backend = DistributedBackend(accelerator)

    def deliver(self, model: torch.nn.Module, version: int) -> Delivery:
        delivery = self.write(model, version)
        if self.accelerator.is_main_process:
            delivery.paused_seconds = self.load(version)
        return delivery

    def write(self, model: torch.nn.Module, version: int) -> Delivery:
        """The trainer's part (every rank: gathers are collectives): ``version``'s weights as files (the main
        process)."""
        main = self.accelerator.is_main_process
        delivery = Delivery()
        size = _model_bytes(model, self.weights_dtype)
        if is_fsdp2_sharded(model):
            with torch.no_grad():
                tensors = server_weights.gathered_full_weights(model, keep=main)
            if main:
                path = self.files.directory(version, size)
                self.files.directories[version] = server_weights.save_full_weights(tensors, path, self.weights_dtype)
        else:
            gathered = list(model.parameters())
            delivery.gathered_bytes = float(partitioned_bytes(gathered))
            with torch.no_grad(), self._backend.gather_params(gathered):
                if main:
                    path = self.files.directory(version, size)
                    if is_peft_model(model):
                        model.merge_adapter()
                        try:
                            server_weights.write_full_weights(model, path, self.weights_dtype)
                        finally:
                            model.unmerge_adapter()
                    else:
                        server_weights.write_full_weights(model, path, self.weights_dtype)
                    self.files.directories[version] = path
        return delivery

    def load(self, version: int) -> float:
        """The servers' part (the main process, no model, no collective: ``background_delivery`` runs it in a
        thread): every server reloads ``version``'s files; returns the seconds they were paused."""
        paused, _ = self.client.reload_weights(version, self.files.directories[version])
        return paused

    def release(self, version: int) -> None:
        self.files.release(version)

    def close(self) -> None:
        self.files.close()


class NCCLTransportUnavailable(RuntimeError):
    """vLLM's NCCL weight transfer cannot run here (no CUDA, no vLLM on the trainer, several servers)."""


def nccl_unavailable_reason(
    cuda_available: bool, vllm_importable: bool, server_count: int, lora: bool, sharded: bool = False
) -> str | None:
    """Why ``vllm_server_weight_transfer="nccl"`` cannot run with these facts, or None if it can."""
    if not cuda_available:
        return "it broadcasts from the trainer's GPU memory to the servers' GPUs, and this machine has no CUDA device"
    if not vllm_importable:
        return "the trainer needs vLLM installed (its NCCLTrainerWeightTransferEngine drives the transfer)"
    if server_count != 1:
        return f"one NCCL group per server is not wired yet, and {server_count} server URLs were given"
    if lora:
        return "it sends full weights, and the policy is synced as a LoRA adapter (set vllm_sync_mode='full')"
    if sharded:
        # A merged LoRA layer, or an FSDP2 DTensor, needs the whole tensor before it is sent: the files transports
        # gather it (server_weights); this one does not yet.
        return "the policy is sharded (ZeRO-3 or FSDP2), which its weight source does not gather yet"
    return None


class _FullWeightSource:
    """vLLM's ``WeightSource`` over the trainer's model: the checkpoint names vLLM loads, in a fixed order, each
    tensor gathered on every rank as it is yielded (ZeRO-3) and cast to the servers' dtype."""

    def __init__(self, model: torch.nn.Module, accelerator: Any, dtype: torch.dtype | None):
        self.model, self.dtype = model, dtype
        self._backend = DistributedBackend(accelerator)

    def _named(self) -> list[tuple[str, torch.nn.Parameter]]:
        peft = is_peft_model(self.model)
        base = self.model.get_base_model() if peft else self.model
        named = []
        for name, param in base.named_parameters():
            checkpoint = server_weights.checkpoint_name(name, peft)
            if checkpoint is not None:
                named.append((checkpoint, param))
        return named

    def metadata(self) -> list:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [
            ParamMeta(name=name, dtype=self.dtype or param.dtype, shape=tuple(getattr(param, "ds_shape", param.shape)))
            for name, param in self._named()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._named():
            with torch.no_grad(), self._backend.gather_params([param]):
                yield name, param.detach().to(self.dtype or param.dtype).contiguous()


class NCCLWeightTransport:
    """vLLM 0.32's NCCL weight transfer to one server (see the module docstring). Written against vLLM's trainer-side
    API (``vllm.distributed.weight_transfer``); the server must be started with
    ``--weight-transfer-config '{"backend": "nccl"}'`` (a server the trainer starts is)."""

    name = "nccl"

    def __init__(
        self,
        accelerator: Any,
        client: VLLMServerClient,
        weights_dtype: torch.dtype | None,
        server_world_size: int,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
    ):
        try:
            import vllm.distributed.weight_transfer.nccl_engine  # noqa: F401

            importable = True
        except ImportError:
            importable = False
        sharded = DistributedBackend(accelerator).is_zero3 or DistributedBackend(accelerator).is_fsdp
        reason = nccl_unavailable_reason(
            torch.cuda.is_available(), importable, len(client.base_urls), client.lora, sharded
        )
        if reason is not None:
            raise NCCLTransportUnavailable(
                f"vllm_server_weight_transfer='nccl' cannot run here: {reason}. Use vllm_server_weight_transfer="
                "'files' (the default)."
            )
        from .vllm_server import free_port

        self.accelerator = accelerator
        self.client = client
        self.weights_dtype = weights_dtype
        self.server_world_size = server_world_size
        self.master_address = master_address
        self.master_port = master_port or free_port(master_address)
        self._engine = None

    def _connect(self, model: torch.nn.Module):
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        init = NCCLTrainerInitInfo(
            master_address=self.master_address,
            master_port=self.master_port,
            world_size=1 + self.server_world_size,  # the main process (the sender) and the server's workers
            rank=self.accelerator.process_index,
        )
        return NCCLTrainerWeightTransferEngine.trainer_init(
            init,
            client=HTTPVLLMWeightSyncClient(self.client.base_urls[0], timeout=self.client.request_timeout),
            source=_FullWeightSource(model, self.accelerator, self.weights_dtype),
        )

    def deliver(self, model: torch.nn.Module, version: int) -> Delivery:
        if self._engine is None:
            self._engine = self._connect(model)
        peft = is_peft_model(model)
        if peft:
            model.merge_adapter()
        try:
            self._engine.send_weights()  # every rank iterates the source (the gathers); the main process sends
        finally:
            if peft:
                model.unmerge_adapter()
        if self.accelerator.is_main_process:
            self.client.full_weights_version = version
        return Delivery()

    def release(self, version: int) -> None:
        """Nothing is kept per version: the servers hold the latest weights."""

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


def build_server_transport(
    kind: str,
    *,
    accelerator: Any,
    client: VLLMServerClient,
    weights_dtype: torch.dtype | None,
    weights_root: str | None = None,
    server_world_size: int = 1,
) -> ServerWeightTransport:
    """The transport for ``vllm_server_weight_transfer`` ``kind`` and the client's sync mode (adapter or full)."""
    if kind not in WEIGHT_TRANSFERS:
        raise ValueError(f"vllm_server_weight_transfer must be one of {WEIGHT_TRANSFERS}, got {kind!r}.")
    if kind == "nccl":
        return NCCLWeightTransport(accelerator, client, weights_dtype, server_world_size)
    if client.lora:
        return AdapterFilesTransport(accelerator, client, weights_root)
    return FullWeightFilesTransport(accelerator, client, weights_dtype, weights_root)
