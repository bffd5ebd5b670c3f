"""Optimizer state to host memory while vLLM generates, back before the optimizer step (as OpenRLHF and NeMo-RL do).

Adam's two fp32 moments are 8 bytes per trainable parameter, often the largest training-side tensor set; during a
rollout they are idle, so they make room for vLLM's weights and KV cache. On a CPU-only machine the states already
live in host memory and nothing moves.
"""

from __future__ import annotations

import torch


class OptimizerStateOffloader:
    def __init__(self, optimizer: torch.optim.Optimizer, host: str | torch.device = "cpu"):
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # unwrap Accelerate's AcceleratedOptimizer
        self.host = torch.device(host)
        self._devices: dict[tuple[int, str], torch.device] = {}
        self.offloaded = False

    def offload(self) -> int:
        """Move every state tensor that is not on the host there; returns the bytes moved."""
        if self.offloaded:
            return 0
        moved = 0
        pin = torch.cuda.is_available()
        for param_id, (_, state) in enumerate(self.optimizer.state.items()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != self.host:
                    self._devices[(param_id, key)] = value.device
                    host_copy = value.to(self.host, non_blocking=True)
                    state[key] = host_copy.pin_memory() if pin else host_copy
                    moved += value.numel() * value.element_size()
        if moved and torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self.offloaded = True
        return moved

    def reload(self) -> int:
        """Bring offloaded states back to their devices; returns the bytes moved."""
        if not self.offloaded:
            return 0
        moved = 0
        for param_id, (_, state) in enumerate(self.optimizer.state.items()):
            for key, value in state.items():
                device = self._devices.get((param_id, key))
                if device is not None:
                    state[key] = value.to(device, non_blocking=True)
                    moved += value.numel() * value.element_size()
        if moved and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._devices.clear()
        self.offloaded = False
        return moved
