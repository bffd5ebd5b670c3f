"""How new weights reach an engine: the transport behind ``RolloutEngine.ensure_version``.

The engine decides *what* to send (the LoRA adapter, or every weight in buckets: ``weight_sync``); a transport
decides *how it travels*. Today's one transport is in-process: the colocated engine's model runner loads the tensors
straight from the trainer's memory, and serves the adapter the trainer wrote. A server engine (asynchronous
generation) adds transports (HTTP adapter loads, NCCL broadcasts, files), not branches in the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from ..compat.vllm_weight_reload import needs_layerwise_reload, reload_weights_in_place

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightTransport(Protocol):
    """Delivers weights to one engine."""

    def load_weights(self, named_weights: NamedTensors) -> None:
        """Replace the engine's weights of these names by these tensors (full sync; a level-2 refill of the base)."""

    def serve_adapter(self, request: Any) -> None:
        """Serve the adapter ``request`` names from the next generation on (LoRA-only sync)."""


class InProcessTransport:
    """The colocated engine's transport: vLLM's model runner lives in this process, so weights are loaded in place
    from the trainer's tensors (through vLLM's in-place reload where its per-parameter path is broken:
    ``compat.vllm_weight_reload``), and the adapter the trainer wrote is attached to the engine's requests."""

    def __init__(self, llm: Any):
        self._llm = llm  # GroupedLLM: the vLLM engine and the adapter its requests carry

    def load_weights(self, named_weights: NamedTensors) -> None:
        worker = self._llm.llm_engine.model_executor.driver_worker
        if needs_layerwise_reload():
            reload_weights_in_place(worker, named_weights)
        else:
            worker.model_runner.model.load_weights(named_weights)

    def serve_adapter(self, request: Any) -> None:
        self._llm.lora_request = request
