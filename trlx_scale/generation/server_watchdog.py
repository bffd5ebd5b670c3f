"""A watchdog between a trainer and the vLLM server it started: the server never outlives the trainer.

Why a process of its own: the server runs in a session of its own (so that stopping it reaches its engine
processes), which also means nothing ends it when the trainer dies without running its clean-up: the OOM killer, a
SIGKILL past a preemption's grace period, a segfault. vLLM then keeps the devices and the port. Linux's parent-death
signal (``PR_SET_PDEATHSIG``) is not enough on its own: it fires when the *thread* that started the child exits (a
trainer that starts its server from a helper thread would lose it), it reaches only the direct child (vLLM's engine
core and workers are grandchildren), and it is Linux-only.

So the server's argv is wrapped: ``python server_watchdog.py --parent-pid P -- <server argv>``. The watchdog is the
leader of the server's session and:

1. starts the server as its child, in a session of its own (signals to its group reach every engine process);
2. polls, every ``POLL_SECONDS``, whether its parent is still process ``P`` (when a process dies its children are
   re-parented, so ``os.getppid()`` changes; that holds whichever thread started the watchdog) and whether the
   server still runs;
3. when the parent is gone: SIGTERM to the whole group, SIGKILL to it ``GRACE_SECONDS`` later, so the server, its
   engine processes and the port are gone within seconds (tested: ``tests/engine/test_server_watchdog.py``);
4. when the server exits on its own, exits with the server's code (start-up failures read as before);
5. if the watchdog itself is SIGKILLed, the server gets SIGKILL from the kernel (``PR_SET_PDEATHSIG``, set in the
   single-threaded watchdog, on Linux). vLLM's engine process does not exit with it (seen: an orphaned
   ``VLLM::EngineCore`` holding 1.9 GB): the watchdog writes the server's pid (``--server-pid-file``), and
   ``VLLMServerProcess.stop`` ends the server's whole group from it, whatever became of the watchdog;
6. on SIGTERM or SIGINT (``VLLMServerProcess.stop`` signals the watchdog), ends the server's group as in step 3
   and exits with the server's code.

A server the user started (``trlx-scale serve`` in its own terminal, or any ``vllm serve``) is not the trainer's
child and is left running; its adapters are unloaded by the trainer as before. ``trlx-scale serve`` wraps its server
the same way, so stopping or killing that command never leaves vLLM behind either.

The file is run as a script (not ``-m``), so it imports nothing of trlx_scale, torch or vLLM: it starts in
milliseconds and holds a few MiB.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

POLL_SECONDS = 0.25
GRACE_SECONDS = 5.0


def wrapped_command(
    argv: list[str], parent_pid: int, server_pid_file: str | None = None, python: str | None = None
) -> list[str]:
    """``argv`` run under the watchdog, bound to process ``parent_pid``; the server's pid (its process group's id)
    is written to ``server_pid_file`` when given."""
    command = [python or sys.executable, os.path.abspath(__file__), "--parent-pid", str(parent_pid)]
    if server_pid_file:
        command += ["--server-pid-file", server_pid_file]
    return [*command, "--", *argv]


def _die_with_parent() -> None:
    """In the server's process before it execs: SIGKILL it if the watchdog dies (a SIGKILL of the watchdog itself
    skips step 3). The parent-death signal's thread caveat does not apply here: the watchdog has one thread."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def end_process_group(
    group: int, leader: subprocess.Popen, grace: float = GRACE_SECONDS, kill_wait: float = 2.0
) -> None:
    """SIGTERM to process group ``group``, SIGKILL if ``leader`` has not exited ``grace`` seconds later, then SIGKILL
    to whatever the group still holds (vLLM's engine processes share the server's group). Also
    ``VLLMServerProcess.stop``'s, on the watchdog's own group."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, kill_wait)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return
        try:
            leader.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        break
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def watch(argv: list[str], parent_pid: int, server_pid_file: str | None = None) -> int:
    """Run ``argv`` while process ``parent_pid`` is this process's parent (the module docstring's steps)."""
    if os.getppid() != parent_pid:  # the parent died before the watchdog got here
        return 1
    stopping = {"signal": None}

    def record_stop(signum, frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGTERM, record_stop)
    signal.signal(signal.SIGINT, record_stop)
    server = subprocess.Popen(argv, start_new_session=True, preexec_fn=_die_with_parent)
    group = server.pid
    if server_pid_file:
        # Whoever started the watchdog can end the server's group even once the watchdog is gone (step 5: the
        # kernel's SIGKILL reaches the server alone; vLLM's engine processes outlive it).
        with open(server_pid_file + ".tmp", "w") as handle:
            handle.write(f"{server.pid}\n")
        os.replace(server_pid_file + ".tmp", server_pid_file)
    try:
        while True:
            code = server.poll()
            if code is not None:
                end_process_group(group, server)  # engine processes a dying server left behind
                return code
            if stopping["signal"] is not None:  # VLLMServerProcess.stop, or a user's kill of the watchdog
                end_process_group(group, server)
                return server.returncode if server.returncode is not None else 1
            if os.getppid() != parent_pid:
                print(
                    f"trlx-scale server watchdog: the trainer (pid {parent_pid}) is gone; stopping its vLLM server "
                    f"(pid {server.pid}).",
                    file=sys.stderr,
                    flush=True,
                )
                end_process_group(group, server)
                return 1
            time.sleep(POLL_SECONDS)
    except BaseException:
        end_process_group(group, server)
        raise


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parent-pid", type=int, required=True, help="the trainer's pid: the server ends with it")
    parser.add_argument("--server-pid-file", default=None, help="where to write the server's pid")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the server's argv, after --")
    parsed = parser.parse_args(args)
    command = parsed.command[1:] if parsed.command[:1] == ["--"] else parsed.command
    if not command:
        parser.error("no server command after --")
    return watch(command, parsed.parent_pid, parsed.server_pid_file)


if __name__ == "__main__":
    sys.exit(main())
