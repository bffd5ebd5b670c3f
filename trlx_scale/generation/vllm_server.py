"""A vLLM OpenAI server as a supervised subprocess: what ``trlx-scale serve`` runs and what an asynchronous trainer
starts itself when it is given no server URL.

The flags are the ones the asynchronous trainer needs (``ServerLaunch.arguments``):

- runtime LoRA loading (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) with ``--max-loras`` at least
  ``max_staleness + 2``: every version a sample in flight may still use, plus the one being loaded;
- the development endpoints (``VLLM_SERVER_DEV_MODE=1``): ``/pause``, ``/resume``, ``/collective_rpc`` (a full-weight
  reload), ``/reset_prefix_cache``;
- ``--logprobs-mode processed_logprobs``: the log-probs of the distribution the engine sampled from, after
  temperature (what the trainer's log-probs are compared with; TRL's colocated engine uses the same mode);
- ``--enable-prefix-caching`` (a group's prompt is computed once for its n samples), ``--dtype``, ``--seed``;
- ``--enable-scale-out``: the token-in/token-out endpoint, whose answers name each token's weight version (full-weight
  reloads that keep requests in flight sample through it: ``token_generate_endpoint``).

The process runs under a watchdog (``server_watchdog.py``) bound to the process that started it: the server and its
engine processes run in a session of their own, so stopping them leaves no engine or worker process behind, and
they end within seconds when the trainer dies without cleaning up (the OOM killer, a SIGKILL past a preemption's
grace period). ``bound_to_parent=False`` leaves that out. Start-up is watched: the server must answer ``/health``
within ``startup_timeout`` seconds, and a server that exits during start-up is reported with the end of its log.
On CPU its KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB (1 unless exported), as for the colocated engine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from ..compat.vllm_checked_reload import WORKER_EXTENSION
from ..compat.vllm_cpu_server_executor import uni_executor_arguments, uni_executor_environment
from ..compat.vllm_server_entrypoint import server_command
from ..progress_notice import PeriodicNotice
from .cpu_environment import KVCACHE_SPACE_ENV, running_on_cpu_only
from .server_watchdog import GRACE_SECONDS, end_process_group, wrapped_command

LOG_TAIL_LINES = 40


class VLLMServerStartError(RuntimeError):
    """The server exited or did not answer during start-up (the message holds the end of its log)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the server is told it explicitly: with ``--port 0`` vLLM never prints the
    port it bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


@dataclass
class ServerLaunch:
    """What to serve and how (see the module docstring for why each flag)."""

    model: str
    host: str = "127.0.0.1"
    port: int | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    enable_lora: bool = True
    max_loras: int = 6
    max_lora_rank: int = 64
    seed: int = 0
    devices: str | None = None
    kvcache_space_gib: int = 1
    weight_transfer: str | None = None  # vLLM's weight-transfer backend ("nccl"); None: updates through files
    extra_args: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}.")
        if self.port is None:
            self.port = free_port(self.host)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def arguments(self, python: str | None = None) -> list[str]:
        """The server's argv."""
        argv = server_command(self.model, python)
        argv += ["--host", self.host, "--port", str(self.port), "--dtype", self.dtype, "--seed", str(self.seed)]
        argv += ["--enable-prefix-caching", "--logprobs-mode", "processed_logprobs"]
        # The token-in/token-out endpoint, whose answers name the weights that sampled each token: what full-weight
        # reloads that keep requests in flight sample through (token_generate_endpoint).
        argv += ["--enable-scale-out"]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        if self.max_model_len:
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.enable_lora:
            argv += ["--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank)]
        if self.weight_transfer:
            argv += ["--weight-transfer-config", json.dumps({"backend": self.weight_transfer})]
        if running_on_cpu_only():
            # vLLM 0.32's CPU sampler cannot seed a request whose prompt is split across prefill chunks ("CPU
            # Generator does not use offset": the engine dies), and every request here is seeded. Whole prompts per
            # step instead, as the colocated engine does (tests/test_compat.py fails once vLLM fixes it); seen with
            # multi-turn trajectories, whose later turns send long held contexts while other prompts are in flight.
            # The step's token budget must then hold the longest prompt (vLLM sizes it from the model's context
            # when no --max-model-len is given).
            argv += ["--no-enable-chunked-prefill"]
            if self.max_model_len:
                argv += ["--max-num-batched-tokens", str(max(4096, self.max_model_len))]
            # The model in the engine-core process: the CPU platform's worker process spins a core for a second
            # after every step (compat.vllm_cpu_server_executor).
            argv += uni_executor_arguments(self.extra_args)
        if "--worker-extension-cls" not in self.extra_args:
            # Full-weight reloads report the parameters they left unloaded (compat.vllm_checked_reload).
            argv += ["--worker-extension-cls", WORKER_EXTENSION]
        return argv + list(self.extra_args)

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The server's environment: the caller's, plus runtime LoRA, the dev endpoints, the devices and, on CPU,
        a small KV cache unless one was exported."""
        env = dict(os.environ if base is None else base)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.devices
        if running_on_cpu_only():
            env.setdefault(KVCACHE_SPACE_ENV, str(self.kvcache_space_gib))
            # On CPU the server shares the cores with the trainers: OpenMP threads that spin between parallel
            # regions (the default) take them from the other process. Both sides must sleep instead (the async
            # example sets it for the trainer): on 2 cores, async GRPO with a 1 s reward made 47 samples/s with
            # both spinning, 53 with the server alone passive, 153 with both (docs/benchmarks.md).
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            env.update(uni_executor_environment(self.arguments()))
        # A training process's torch.distributed variables must not reach the server's own process group.
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        return env

    def shell_command(self) -> str:
        """The command a user runs by hand for this server (what ``trlx-scale serve`` prints)."""
        env = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 VLLM_SERVER_DEV_MODE=1"
        if self.devices is not None:
            env += f" CUDA_VISIBLE_DEVICES={self.devices}"
        arguments = self.arguments()
        if running_on_cpu_only():
            env += f" {KVCACHE_SPACE_ENV}={os.environ.get(KVCACHE_SPACE_ENV, self.kvcache_space_gib)}"
            env += "".join(f" {name}={value}" for name, value in uni_executor_environment(arguments).items())
        return env + " " + " ".join(arguments)


class VLLMServerProcess:
    """A running server: ``start`` waits until it answers, ``stop`` ends it and its engine processes.

    ``bound_to_parent`` (the default) runs it under the watchdog: it ends when this process does, however this
    process ends. ``process`` is then the watchdog, whose exit code is the server's."""

    def __init__(
        self,
        launch: ServerLaunch,
        startup_timeout: float = 300.0,
        log_path: str | None = None,
        bound_to_parent: bool = True,
    ):
        self.launch = launch
        self.startup_timeout = startup_timeout
        self.bound_to_parent = bound_to_parent
        self.log_path = log_path or tempfile.mkstemp(prefix="trlx-scale-vllm-server-", suffix=".log")[1]
        # The server's pid, written by the watchdog: its process group holds vLLM's engine processes.
        self.server_pid_file = self.log_path + ".server.pid"
        self._group: int | None = None
        self.process: subprocess.Popen | None = None
        # The start-up's progress lines (None: one every PROGRESS_EVERY_SECONDS to the log).
        self.progress: PeriodicNotice | None = None

    @property
    def url(self) -> str:
        return self.launch.url

    def start(self) -> VLLMServerProcess:
        if self.process is not None:
            raise RuntimeError("this server was already started.")
        with open(self.log_path, "ab") as log:
            argv = self.launch.arguments()
            if self.bound_to_parent:
                argv = wrapped_command(argv, parent_pid=os.getpid(), server_pid_file=self.server_pid_file)
            self.process = subprocess.Popen(
                argv,
                env=self.launch.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.startup_timeout
        progress = self.progress or PeriodicNotice(f"vLLM server for {self.launch.model}")
        while True:
            progress.tick(lambda elapsed: f"starting for {elapsed:.0f} s; its log says: {self.newest_log_line()}")
            code = self.process.poll()
            if code is not None:
                self._end_server_group()
                raise VLLMServerStartError(
                    f"the vLLM server for {self.launch.model} exited with code {code} during start-up. "
                    f"The end of its log ({self.log_path}):\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise VLLMServerStartError(
                    f"the vLLM server for {self.launch.model} did not answer {self.url}/health within "
                    f"{self.startup_timeout:.0f} s (vllm_server_timeout). The end of its log ({self.log_path}):\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_for_exit(self, timeout: float) -> bool:
        """Whether the server process has exited within ``timeout`` seconds (False: it is still running)."""
        if self.process is None:
            return False
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def exit_report(self) -> str:
        """Why the server is gone, for an error message: its exit code and the end of its log."""
        code = None if self.process is None else self.process.poll()
        state = "is running" if code is None else f"exited with code {code}"
        return f"the server process {state}; the end of its log ({self.log_path}):\n{self.log_tail()}"

    def newest_log_line(self) -> str:
        """The last non-empty line of the server's log (what it is doing during start-up)."""
        lines = [line for line in self.log_tail(5).splitlines() if line.strip()]
        return lines[-1].strip() if lines else "(nothing yet)"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, errors="replace") as log:
                return "".join(log.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to the server's session, SIGKILL after ``timeout`` seconds: no engine process is left behind (under
        the watchdog, the SIGTERM reaches the watchdog, which ends the server's own session within
        ``GRACE_SECONDS``)."""
        if self.process is None:
            return
        timeout = max(timeout, GRACE_SECONDS + 3.0) if self.bound_to_parent else timeout
        end_process_group(self.process.pid, self.process, grace=timeout, kill_wait=5.0)
        self._end_server_group()

    def _server_group(self) -> int | None:
        """The server's process group under the watchdog (None: not bound, or not started yet)."""
        if self._group is None:
            try:
                with open(self.server_pid_file) as handle:
                    self._group = int(handle.read().strip())
            except (OSError, ValueError):
                return None
        return self._group

    def server_group_alive(self) -> bool:
        """Whether any process of the server's group (vLLM's API server, its engine processes) still runs."""
        group = self._server_group() if self.bound_to_parent else (self.process.pid if self.process else None)
        if group is None:
            return False
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        return True

    def _end_server_group(self) -> None:
        """SIGKILL what is left of the server's group: the watchdog ends it on its way out, but a watchdog killed
        by SIGKILL could not (its server then dies by the kernel's signal and leaves vLLM's engine behind)."""
        group = self._server_group()
        if group is None:
            return
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.remove(self.server_pid_file)
        except OSError:
            pass

    def __enter__(self) -> VLLMServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
