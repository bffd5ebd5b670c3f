"""trlx_scale/process_exit.py: a script that ends through run_then_exit leaves with the status, the output and the
side effects of an ordinary interpreter exit (threads joined, atexit handlers run, buffered output flushed); only the
teardown of the modules is skipped. Each case runs in a process of its own."""

from __future__ import annotations

import atexit
import subprocess
import sys
import textwrap

import pytest

from .helpers.launch import REPO_ROOT

SCRIPT = """
import atexit, sys, threading, time, weakref
from concurrent.futures import ThreadPoolExecutor
from trlx_scale.process_exit import run_then_exit, skip_at_exit

marks = sys.argv[1]

def mark(name):
    with open(marks, "a") as handle:
        handle.write(name + "\\n")

atexit.register(mark, "atexit")

def late_worker():
    time.sleep(0.3)
    mark("thread")

class Resource:
    pass

alive = [Resource(), Resource()]

pool = ThreadPoolExecutor(max_workers=1)  # its worker idles at the exit: threading's exit callback ends it

def main():
    pool.submit(lambda: (time.sleep(0.1), mark("pool")))  # a task still running when main() returns
    skip_at_exit(weakref.finalize(alive[0], mark, "skipped-finalizer"))  # run by an ordinary exit only
    weakref.finalize(alive[1], mark, "finalizer")
    threading.Thread(target=late_worker).start()  # non-daemon: joined before the exit handlers
    sys.stdout.write("buffered, no newline")
    {ending}

run_then_exit(main)
"""


def _run(tmp_path, ending: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    marks = tmp_path / "marks.txt"
    script = SCRIPT.replace("{ending}", ending)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(marks)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,  # an exit that joins the pool's idle worker without telling it to stop waits forever
    )
    return result, marks.read_text().split() if marks.exists() else []


@pytest.mark.parametrize(
    ("ending", "status", "stderr"),
    [
        ("return {'steps': 3}", 0, ""),
        ("raise SystemExit(75)", 75, ""),  # a preempted run's status
        ("raise SystemExit('cannot go on')", 1, "cannot go on"),
    ],
    ids=["returns", "exit-75", "exit-message"],
)
def test_the_exit_keeps_the_status_output_threads_and_exit_handlers(tmp_path, ending, status, stderr):
    result, marks = _run(tmp_path, ending)
    assert result.returncode == status, result.stderr[-2000:]
    assert result.stdout == "buffered, no newline"
    assert result.stderr.strip() == stderr
    # The thread and the pool's task ended before the handlers ran, the finalizers' handler (registered last) ran
    # first, as in an ordinary exit; the finalizer handed to skip_at_exit did not run.
    assert sorted(marks[:2]) == ["pool", "thread"] and marks[2:] == ["finalizer", "atexit"]


def test_an_exception_takes_the_ordinary_exit(tmp_path):
    result, marks = _run(tmp_path, "raise ValueError('bad reward column')")
    assert result.returncode == 1
    assert "ValueError: bad reward column" in result.stderr and "Traceback" in result.stderr
    assert sorted(marks[:2]) == ["pool", "thread"]
    assert marks[2:] == ["finalizer", "skipped-finalizer", "atexit"]  # skip_at_exit is exit_process's alone


def test_the_interpreter_still_has_the_hooks_the_exit_runs():
    """exit_process runs the interpreter's own first steps through threading._shutdown and atexit._run_exitfuncs
    (CPython's, undocumented); without them it falls back to sys.exit, which is correct and slow. This fails first
    if an interpreter drops either."""
    import threading

    assert callable(getattr(threading, "_shutdown", None)) and callable(getattr(atexit, "_run_exitfuncs", None))
