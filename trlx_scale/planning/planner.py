"""The planner: every requested backend on the given GPUs, and the cheapest layout that fits.

"Cheapest" is fewest GPUs first (whole nodes beyond one node; powers of two within one), then no offload before
offload (offload trades step time for memory), then the simpler backend (DDP, ZeRO-2, FSDP2, ZeRO-3).
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Accelerator
from .memory_model import PLAN_BACKENDS, Layout, Plan, RunSpec, role_memory

PREFERENCE = ("ddp", "zero2", "fsdp2", "zero3")


@dataclass
class PlanReport:
    run: RunSpec
    accelerator: Accelerator
    plans: list[Plan]
    recommendation: Plan | None

    def as_dict(self) -> dict:
        model = self.run.model.complete()
        return {
            "model": {
                "name": model.name,
                "params": model.total_params,
                "layers": model.layers,
                "hidden": model.hidden,
                "heads": model.heads,
                "kv_heads": model.kv,
                "vocab": model.vocab,
                "intermediate": model.intermediate,
                "experts": model.experts,
            },
            "algo": self.run.algo,
            "lora_rank": self.run.lora_rank,
            "gpu": self.accelerator.name,
            "gpu_memory_gib": self.accelerator.memory_gib,
            "backends": {_key(p.layout): p.as_dict() for p in self.plans},
            "recommendation": None if self.recommendation is None else self.recommendation.as_dict(),
        }


def _key(layout: Layout) -> str:
    return layout.backend + ("+offload" if layout.offload else "")


def candidate_gpu_counts(nodes: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """(nodes, gpus per node) from the smallest to the given size."""
    counts = []
    if nodes == 1:
        g = 1
        while g < gpus_per_node:
            counts.append((1, g))
            g *= 2
        counts.append((1, gpus_per_node))
    else:
        counts = [(n, gpus_per_node) for n in range(1, nodes + 1)]
    return counts


def plan(
    run: RunSpec,
    accelerator: Accelerator,
    nodes: int = 1,
    gpus_per_node: int = 8,
    backends: tuple[str, ...] = PLAN_BACKENDS,
    offload: bool = False,
) -> PlanReport:
    """Plans for each backend on nodes x gpus_per_node, and the recommendation (searched up to that size)."""
    unknown = [b for b in backends if b not in PLAN_BACKENDS]
    if unknown:
        raise ValueError(f"--backend: unknown {unknown}; choose from {', '.join(PLAN_BACKENDS)}.")
    tp = run.vllm_tensor_parallel_size
    if tp < 1 or gpus_per_node % tp != 0:
        raise ValueError(
            f"--vllm-tp ({tp}) must divide --gpus-per-node ({gpus_per_node}): a colocated engine's tensor-parallel "
            f"group stays inside one node. Use one of {[d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0]}."
        )
    memory = accelerator.memory_gib
    plans = []
    for backend in backends:
        plans.append(role_memory(run, Layout(backend, False, nodes, gpus_per_node), memory))
        if offload and backend != "ddp":
            plans.append(role_memory(run, Layout(backend, True, nodes, gpus_per_node), memory))
    recommendation = None
    ordered = [b for b in PREFERENCE if b in backends]
    for count_nodes, count_gpus in candidate_gpu_counts(nodes, gpus_per_node):
        if count_gpus % tp:
            continue
        for with_offload in (False, True) if offload else (False,):
            for backend in ordered:
                if with_offload and backend == "ddp":
                    continue
                candidate = role_memory(run, Layout(backend, with_offload, count_nodes, count_gpus), memory)
                if candidate.fits:
                    recommendation = candidate
                    break
            if recommendation:
                break
        if recommendation:
            break
    return PlanReport(run, accelerator, plans, recommendation)
