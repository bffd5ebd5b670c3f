"""Running examples and scripts the way a user does: subprocesses, `accelerate launch`, torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")

# torch.distributed variables a colocated engine earlier in this pytest process exported (and whose port that process
# still holds): a launched example must pick its own, or its process group fails with EADDRINUSE.
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def launch_env() -> dict:
    """This process's environment without the torch.distributed variables (see LAUNCH_VARIABLES), for a child run."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    for name in LAUNCH_VARIABLES:
        env.pop(name, None)
    return env


def run_command(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a command from the repository root with a clean torch.distributed environment; fail with its output."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    for name in LAUNCH_VARIABLES:
        env.pop(name, None)
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


def read_run_summary(output_dir) -> dict:
    """The `run_summary.json` an example writes into its output directory."""
    with open(os.path.join(output_dir, "run_summary.json")) as handle:
        return json.load(handle)


def run_torchrun_report(script: str, report_path, port: int, arguments: list[str] = ()) -> dict:
    """Run tests/distributed/<script> as 2 gloo processes under torchrun (``arguments`` first, then the report's
    path) and return the JSON report it writes."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    path = os.path.join(REPO_ROOT, "tests", "distributed", script)
    result = subprocess.run(
        [*command, path, *arguments, str(report_path)], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT
    )
    assert result.returncode == 0, result.stderr[-4000:]
    with open(report_path) as handle:
        return json.load(handle)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own, out of its process group)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_process_tree(process: subprocess.Popen) -> None:
    """kill -9 a run as a preemption does: the launcher and every process below it (``os.killpg`` misses the ranks
    torchrun starts in sessions of their own, which then live on after the test)."""
    for pid in [process.pid, *descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=60)
