"""Running examples and scripts the way a user does: subprocesses, `accelerate launch`, torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")  # the documented command, for its own tests
# `accelerate launch` itself (accelerate.commands.launch: the same parser and launcher, and what `trlx-scale grpo`
# runs) without the `accelerate` command's start-up: that command imports every subcommand, and `estimate` imports
# transformers' model registry, 7 s before it launches anything against 3 s here (measured on this machine's 2 cores).
ACCELERATE_LAUNCH = (sys.executable, "-m", "accelerate.commands.launch")

# torch.distributed variables a colocated engine earlier in this pytest process exported (and whose port that process
# still holds): a launched example must pick its own, or its process group fails with EADDRINUSE.
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")

# What tests/conftest.py sets for the suite's speed alone (see there); a run that stands for a user's own leaves it out.
SUITE_ONLY_VARIABLES = ("TORCH_COMPILE_DISABLE",)


def launch_env(as_a_user: bool = False) -> dict:
    """This process's environment without the torch.distributed variables (see LAUNCH_VARIABLES), for a child run;
    ``as_a_user``: without the suite's own settings either (SUITE_ONLY_VARIABLES)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    for name in (*LAUNCH_VARIABLES, *(SUITE_ONLY_VARIABLES if as_a_user else ())):
        env.pop(name, None)
    return env


def run_command(command: list[str], timeout: float, as_a_user: bool = False) -> subprocess.CompletedProcess:
    """Run a command from the repository root with a clean torch.distributed environment; fail with its output.
    ``as_a_user``: without the suite's own settings (SUITE_ONLY_VARIABLES), as a user's shell runs it."""
    env = dict(launch_env(as_a_user), VLLM_CPU_KVCACHE_SPACE="1")
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


def result_line(stdout: str) -> dict:
    """The JSON of a script's "RESULT {...}" line (tests/scripts/interrupted_run.py prints one)."""
    line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def run_result(command: list[str]) -> dict:
    """Run a script that prints a RESULT line, from the repository root; fail with its output."""
    done = subprocess.run(command, cwd=REPO_ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return result_line(done.stdout)


def signal_once_progressed(command, pid_dir, target_rank: int, signals, after_step: int = 2):
    """Start the run, wait until rank 0 finished ``after_step`` steps, send ``signals`` to rank ``target_rank``;
    return (exit code, output, rank 0's last finished step when the run ended, seconds from the first signal to the
    run's exit)."""
    import time

    from trlx_scale.reliability.preemption import REPEAT_WINDOW_S

    process = subprocess.Popen(
        command, cwd=REPO_ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    progress = os.path.join(pid_dir, "progress")
    deadline = time.monotonic() + 400
    while not (os.path.exists(progress) and int(open(progress).read() or 0) >= after_step):
        assert process.poll() is None, process.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "the run never reached the step to signal"
        time.sleep(0.05)
    with open(os.path.join(pid_dir, f"rank{target_rank}.pid")) as handle:
        pid = int(handle.read())
    signalled = time.monotonic()
    for index, number in enumerate(signals):
        if index:
            time.sleep(REPEAT_WINDOW_S + 0.5)  # closer signals count as one notice delivered twice
        os.kill(pid, number)
    output, _ = process.communicate(timeout=300)
    return process.returncode, output, int(open(progress).read()), time.monotonic() - signalled
