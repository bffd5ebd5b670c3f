"""The server never outlives the trainer that started it: SIGKILL the trainer (as the OOM killer or a preemption's
grace period does) and the server, its engine processes and its port are gone within 10 s. Once with a stand-in
server that has a child of its own (seconds), once with the real vLLM server on the embedded model (start-up ~30 s).
A user's own server (``trlx-scale serve`` in its own terminal) is not the trainer's child: nothing here touches it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers.launch import REPO_ROOT, descendants, launch_env
from trlx_scale.generation.server_watchdog import wrapped_command
from trlx_scale.generation.vllm_server import ServerLaunch, VLLMServerProcess, free_port

# A stand-in for vLLM's API server: listens on a port and starts an "engine" child that ignores SIGTERM (as a busy
# engine process may), so only the watchdog's SIGKILL of the whole group ends it.
STAND_IN_SERVER = textwrap.dedent(
    """
    import signal, socket, subprocess, sys, time
    engine = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    listener = socket.socket(); listener.bind(("127.0.0.1", int(sys.argv[1]))); listener.listen()
    print("serving", flush=True)
    time.sleep(600)
    """
)

# The "trainer": starts a server and reports what it started, then waits to be killed.
TRAINER_STARTING_A_STAND_IN = textwrap.dedent(
    """
    import subprocess, sys, time
    from trlx_scale.generation.server_watchdog import wrapped_command
    import os
    argv = wrapped_command([sys.executable, "-c", sys.argv[1], sys.argv[2]], parent_pid=os.getpid())
    server = subprocess.Popen(argv, start_new_session=True)
    print(server.pid, flush=True)
    time.sleep(600)
    """
)

# A stand-in that answers /health as vLLM's server does, with the same SIGTERM-ignoring engine child.
STAND_IN_HTTP_SERVER = textwrap.dedent(
    """
    import subprocess, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    engine = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
    """
)

TRAINER_STARTING_VLLM = textwrap.dedent(
    """
    import sys, time
    from trlx_scale.generation.vllm_server import ServerLaunch, VLLMServerProcess
    launch = ServerLaunch(model=sys.argv[1], dtype="float32", max_model_len=128, port=int(sys.argv[2]),
                          enable_lora=False)
    server = VLLMServerProcess(launch, startup_timeout=300).start()
    print(server.process.pid, flush=True)
    time.sleep(600)
    """
)


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    """Running (a zombie that only waits for its parent to reap it holds no memory, device or port)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_trainer(script: str, *arguments: str) -> tuple[subprocess.Popen, int]:
    trainer = subprocess.Popen(
        [sys.executable, "-c", script, *arguments],
        cwd=REPO_ROOT,
        env=launch_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    line = trainer.stdout.readline()
    assert line.strip().isdigit(), f"the trainer did not start its server (exit {trainer.poll()})"
    return trainer, int(line)


def _kill_trainer_and_wait_for(pids: list[int], port: int, trainer: subprocess.Popen, within: float) -> float:
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait(timeout=10)
    killed = time.monotonic()
    while time.monotonic() - killed < within:
        if not any(_alive(pid) for pid in pids) and not _listening(port):
            return time.monotonic() - killed
        time.sleep(0.2)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:  # do not leave them to the rest of the suite
        os.kill(pid, signal.SIGKILL)
    pytest.fail(f"{within:.0f} s after the trainer's SIGKILL, processes {left} or port {port} were still alive")


def _wait_until_listening(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not _listening(port):
        assert time.monotonic() < deadline, f"nothing listened on {port} within {timeout:.0f} s"
        time.sleep(0.2)


def test_a_killed_trainer_takes_the_server_and_its_engine_process_with_it():
    port = free_port()
    trainer, watchdog = _start_trainer(TRAINER_STARTING_A_STAND_IN, STAND_IN_SERVER, str(port))
    _wait_until_listening(port, timeout=30)
    tree = [watchdog, *descendants(watchdog)]
    assert len(tree) == 3, f"watchdog, server and engine expected, found {tree}"
    _kill_trainer_and_wait_for(tree, port, trainer, within=10)  # fails, naming what is left, if any outlives it


def test_the_watchdog_exits_with_the_servers_code():
    """A server that dies during start-up is reported with its own exit code (``VLLMServerProcess.start``)."""
    argv = wrapped_command([sys.executable, "-c", "raise SystemExit(3)"], parent_pid=os.getpid())
    assert subprocess.run(argv, timeout=30).returncode == 3


class _StandInLaunch(ServerLaunch):
    def arguments(self, python: str | None = None) -> list[str]:
        return [sys.executable, "-c", STAND_IN_HTTP_SERVER, str(self.port)]


def test_a_sigkilled_watchdog_takes_the_server_with_it_and_stop_ends_what_is_left():
    """SIGKILL the watchdog itself (as a test that kills ``server.process`` does): the kernel kills the server, its
    port closes, and its engine child (which ignores SIGTERM, like a busy vLLM engine) is ended by
    ``VLLMServerProcess.stop`` through the server's group. Before, that engine lived on (seen in a full run: two
    orphaned ``VLLM::EngineCore`` processes holding 1.9 GB each until the machine stopped)."""
    server = VLLMServerProcess(_StandInLaunch(model="stand-in"), startup_timeout=30).start()
    try:
        engine = [pid for pid in descendants(server.process.pid) if pid != server._server_group()]
        assert len(engine) == 1 and server.server_group_alive()
        os.kill(server.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _listening(server.launch.port):
            assert time.monotonic() < deadline, "the server outlived its SIGKILLed watchdog by 10 s"
            time.sleep(0.2)
        assert _alive(engine[0]) and server.server_group_alive()  # what the kernel's signal does not reach
    finally:
        server.stop()
    deadline = time.monotonic() + 5
    while server.server_group_alive() or _alive(engine[0]):
        assert time.monotonic() < deadline, "stop() left the server's engine running"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_killed_trainer_takes_its_real_vllm_server_with_it(default_model_dir):
    port = free_port()
    trainer, watchdog = _start_trainer(TRAINER_STARTING_VLLM, default_model_dir, str(port))
    assert _listening(port)
    tree = [watchdog, *descendants(watchdog)]
    assert len(tree) >= 2, f"the watchdog and vLLM's server expected, found {tree}"
    seconds = _kill_trainer_and_wait_for(tree, port, trainer, within=10)
    print(f"vLLM server and {len(tree) - 1} processes gone {seconds:.1f} s after the trainer's SIGKILL")
