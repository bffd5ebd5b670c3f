"""Accelerators the planner knows, by the names `trlx-scale plan --gpu` takes.

Memory is what the device reports to CUDA (``nvidia-smi``'s total, in GiB); ``--gpu-memory-gb`` overrides it for
anything not listed. Peak dense bf16 throughput (no sparsity) is from each vendor's data sheet; HBM bandwidth too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gib: float
    bf16_tflops: float | None = None
    bandwidth_tb_s: float | None = None


ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA A100 data sheet (SXM): 312 TFLOPS bf16 dense; 1.56 / 2.04 TB/s.
    "a100-40": Accelerator("a100-40", 40.0, 312.0, 1.56),
    "a100-80": Accelerator("a100-80", 80.0, 312.0, 2.04),
    # H100 SXM: 989 TFLOPS bf16 dense, 3.35 TB/s; 81559 MiB reported.
    "h100": Accelerator("h100", 79.6, 989.0, 3.35),
    # H200 SXM: same compute as H100, 141 GB HBM3e (143771 MiB reported), 4.8 TB/s.
    "h200": Accelerator("h200", 140.4, 989.0, 4.8),
    # L40S: 362 TFLOPS bf16 dense, 48 GB GDDR6 (46068 MiB reported), 0.86 TB/s.
    "l40s": Accelerator("l40s", 45.0, 362.0, 0.86),
    # A10G (AWS g5): 24 GB (23028 MiB reported), 125 TFLOPS bf16 dense, 0.6 TB/s.
    "a10g": Accelerator("a10g", 22.5, 125.0, 0.6),
}


def resolve_accelerator(name: str | None, memory_gb: float | None) -> Accelerator:
    """The accelerator for `--gpu NAME` and/or `--gpu-memory-gb X` (the explicit size wins)."""
    if name is None and memory_gb is None:
        raise ValueError("Give --gpu (one of " + ", ".join(ACCELERATORS) + ") or --gpu-memory-gb for another device.")
    if memory_gb is not None and memory_gb <= 0:
        raise ValueError(f"--gpu-memory-gb must be positive, got {memory_gb}.")
    if name is None:
        return Accelerator(f"{memory_gb:g} GiB", float(memory_gb))
    key = name.lower()
    if key not in ACCELERATORS:
        if memory_gb is None:
            raise ValueError(
                f"--gpu {name!r} is not in the table ({', '.join(ACCELERATORS)}): pass --gpu-memory-gb with its "
                "memory in GiB (as nvidia-smi reports it)."
            )
        return Accelerator(name, float(memory_gb))
    known = ACCELERATORS[key]
    if memory_gb is None:
        return known
    return Accelerator(known.name, float(memory_gb), known.bf16_tflops, known.bandwidth_tb_s)
