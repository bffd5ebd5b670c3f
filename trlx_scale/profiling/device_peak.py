"""Peak FLOP/s of the device a process trains on: the denominator of MFU.

GPUs: dense bf16 tensor-core peaks from the vendors' data sheets (no sparsity), matched on the device name.
CPUs: no data sheet applies (cores, AVX-512/AMX, clocks and the threads torch uses all matter), so the peak is a
short measured matmul in the training dtype, best of a few runs: MFU on CPU reads "fraction of what this process's
matmuls reach here". ``peak_tflops`` in the config overrides both.
"""

from __future__ import annotations

import functools
import time

import torch

# Dense bf16 TFLOP/s (NVIDIA data sheets; SXM parts; H200 has H100's compute). Longest name first when matching.
GPU_PEAK_BF16_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100 PCIE": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
}


def gpu_peak_tflops(device_name: str) -> float | None:
    """The table's peak for a CUDA device name, or None when the device is not in it."""
    name = device_name.upper()
    for key in sorted(GPU_PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return GPU_PEAK_BF16_TFLOPS[key]
    return None


@functools.lru_cache(maxsize=4)
def measured_cpu_peak_tflops(dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 3) -> float:
    """Best TFLOP/s of a ``size``-square matmul in ``dtype`` on this process's threads (~0.1 s, once per process)."""
    # A private generator: drawing from the global one would change the run's sampling (and its reproducibility).
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    torch.mm(a, b)  # warm-up: thread pool, kernels
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / max(best, 1e-9) / 1e12


def device_peak_tflops(device: torch.device, dtype: torch.dtype, override: float | None = None) -> float | None:
    """Peak TFLOP/s for MFU: ``override`` if given, the table on CUDA, a measured matmul on CPU; None if unknown."""
    if override is not None:
        return float(override)
    if device.type == "cuda":
        return gpu_peak_tflops(torch.cuda.get_device_name(device))
    if device.type == "cpu":
        return measured_cpu_peak_tflops(dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32)
    return None
