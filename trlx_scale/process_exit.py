"""Ending a training script's process without CPython's module teardown (4 s or more per process, every run).

After a run, a process that has imported torch, Transformers, TRL and vLLM spends seconds in the interpreter's own
finalization: it clears thousands of modules and runs full garbage collections over millions of objects, work whose
only result is memory the operating system takes back anyway. Measured on a 2-core machine
(``benchmarks/process_exit.py``, docs/benchmarks.md): 4.5 s for a script that only imports TRL's and trlx_scale's
trainers, 4.3 s saved on one step of examples/ppo.py, 7-12 s while the machine was loaded. Multi-process runs pay it
on every rank.

``exit_process`` does every part of an interpreter exit that has an effect outside the process, in the same order:
threading's exit callbacks and the join of the non-daemon threads (a ThreadPoolExecutor's workers, an asynchronous
checkpoint's writer), the ``atexit`` handlers (logging's flush, multiprocessing's children, temporary directories, an
asynchronous trainer's server), the flush of stdout, stderr and C's stdio buffers, and then leaves with ``os._exit``,
as multiprocessing's own child processes do. Skipped: the teardown of the modules, and the finalizers handed to
``skip_at_exit``, whose work stays inside the process (the colocated vLLM engine's shutdown frees its memory and
resets vLLM's process-global groups: 2-4 s of garbage collection, compat/vllm_engine_finalizers.py). What a script
leaves to the teardown alone is lost: a file it opened and never closed keeps its unwritten bytes.

Why not ``gc.freeze()`` at exit instead (the collections would skip the frozen heap): the objects it keeps include
Triton's nanobind bindings (imported through vLLM's structured outputs), whose leak check then prints some hundred
lines of "nanobind: leaked ..." at every exit.

The scripts (``trlx-scale grpo|ppo|dpo``, ``examples/*.py``) end with ``run_then_exit(main)``; a script of one's own
can do the same. A script that ends without it is unchanged, only slower to exit.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import NoReturn

# Finalizers whose work only matters to a process that goes on (see skip_at_exit). A finalizer holds its object
# only weakly, and one that has run is dead and dropped at the next registration.
_SKIPPED_AT_EXIT: list[weakref.finalize] = []


def skip_at_exit(finalizer: weakref.finalize) -> None:
    """Let ``exit_process`` leave without calling ``finalizer`` (an ordinary exit still calls it)."""
    _SKIPPED_AT_EXIT[:] = [kept for kept in _SKIPPED_AT_EXIT if kept.alive]
    _SKIPPED_AT_EXIT.append(finalizer)


def exit_process(code: int = 0) -> NoReturn:
    """Leave the process with exit status ``code`` after everything an interpreter exit does outside the process."""
    # The interpreter's own first two steps, in its order: threading's exit callbacks (a ThreadPoolExecutor's tell
    # its idle workers to stop) and the join of the non-daemon threads, then the atexit handlers. Both are CPython's,
    # undocumented; without either, the ordinary exit (tests/test_process_exit.py pins them).
    shut_threads_down = getattr(threading, "_shutdown", None)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if shut_threads_down is None or run_exit_handlers is None:
        sys.exit(code)
    shut_threads_down()
    for finalizer in _SKIPPED_AT_EXIT:
        finalizer.atexit = False  # weakref.finalize's own switch: not called at exit, and never after it
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced by something without flush()
            pass
    _flush_c_streams()
    os._exit(code)


def _flush_c_streams() -> None:
    """What C and C++ libraries wrote through stdio and left in its buffers (exit() flushes them; os._exit does not)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (AttributeError, OSError):  # no C library to ask: nothing of ours is buffered there
        pass


def _exit_status(stop: SystemExit) -> int:
    """The status the interpreter gives ``SystemExit(code)``: None is 0, an int is itself, anything else is printed
    to stderr and is 1."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """Run a script's ``main()`` and leave through ``exit_process``: status 0 when it returns, the ``SystemExit``'s
    status when it raises one (``--help``, a preempted run's 75). Any other exception propagates unchanged: its
    traceback and status 1 come from the ordinary exit."""
    try:
        main()
    except SystemExit as stop:
        exit_process(_exit_status(stop))
    exit_process(0)
