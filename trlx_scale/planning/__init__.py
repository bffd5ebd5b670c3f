"""Memory and parallelism planning for RL runs (``trlx-scale plan``): pure Python, no GPU needed."""

from .hardware import ACCELERATORS, Accelerator, resolve_accelerator
from .memory_model import ALGORITHMS, PLAN_BACKENDS, PRECISIONS, Layout, Plan, RoleMemory, RunSpec, role_memory
from .model_shape import ALL_LINEAR, ModelShape
from .planner import PlanReport, plan
from .resource_split import Split, balance

__all__ = [
    "ACCELERATORS",
    "ALGORITHMS",
    "ALL_LINEAR",
    "PLAN_BACKENDS",
    "PRECISIONS",
    "Accelerator",
    "Layout",
    "ModelShape",
    "Plan",
    "PlanReport",
    "RoleMemory",
    "RunSpec",
    "Split",
    "balance",
    "plan",
    "resolve_accelerator",
    "role_memory",
]
