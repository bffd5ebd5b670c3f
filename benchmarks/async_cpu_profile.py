"""Where the CPU goes in a step: synchronous GRPO against AsyncGRPOTrainer on a real vLLM server, no reward latency.

The asynchronous trainer runs at 0.6-0.7x the synchronous one on this 2-core machine when the reward costs nothing
(0.44x before the CPU server lost its spinning worker: docs/benchmarks.md). This measures why, per step, from the operating system's CPU accounting (``psutil``):
the trainer process's CPU seconds, split by thread (the training loop, torch's worker, the rollout producer that
samples and scores on the servers), and the vLLM server's (its API server, engine core and worker processes), over
steps ``--skip``..``--steps`` of each run. Each setting runs in a process of its own, as in
``benchmarks/async_grpo.py --server`` (same model, LoRA, 128 samples per step and thread settings).

    python benchmarks/async_cpu_profile.py --repeats 3

Results and the command: docs/benchmarks.md ("Where the CPU goes").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def _cpu_seconds(process) -> float:
    import psutil

    total = 0.0
    for member in [process, *process.children(recursive=True)]:
        try:
            times = member.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def profile_one(kind: str, url: str, cli: argparse.Namespace) -> dict[str, float]:
    """One run in this process: per-step wall and CPU seconds between the ends of steps ``skip`` and ``steps``."""
    import async_grpo
    import psutil
    from transformers import TrainerCallback

    me = psutil.Process()
    server = None
    if kind == "async":
        port = int(url.rsplit(":", 1)[1])
        server = next(
            p
            for p in psutil.process_iter(["cmdline"])
            if str(port) in " ".join(p.info["cmdline"] or []) and "api_server" in " ".join(p.info["cmdline"] or [])
        )
    marks = {}

    class Mark(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (cli.skip, cli.steps):
                threads = {t.id: t.user_time + t.system_time for t in me.threads()}
                names = {t.native_id: t.name for t in threading.enumerate()}
                server_cpu = _cpu_seconds(server) if server is not None else 0.0
                marks[state.global_step] = (time.monotonic(), threads, names, server_cpu)

    run = argparse.Namespace(samples_per_step=cli.samples_per_step, server_steps=cli.steps)
    with tempfile.TemporaryDirectory() as workdir:
        async_grpo.run_server_config(run, kind, cli.max_staleness, 0.0, url, cli.seed, workdir, callbacks=[Mark()])
    (start, threads0, names, server0), (end, threads1, _, server1) = marks[cli.skip], marks[cli.steps]
    steps = cli.steps - cli.skip
    per_thread = {tid: (threads1[tid] - threads0.get(tid, 0.0)) / steps for tid in threads1}
    named = {"main": 0.0, "producer": 0.0, "other threads": 0.0}
    for tid, seconds in per_thread.items():
        name = names.get(tid, "")
        key = "main" if name == "MainThread" else "producer" if "producer" in name else "other threads"
        named[key] += seconds
    return {
        "wall": (end - start) / steps,
        "trainer process": sum(per_thread.values()),
        **{f"trainer: {key}": value for key, value in named.items()},
        "server processes": (server1 - server0) / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="steps before the measured ones (start-up, filling)")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--samples-per-step", type=int, default=128)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--one", nargs=2, default=None, help=argparse.SUPPRESS)  # internal: kind url
    cli = parser.parse_args()
    if cli.one is not None:
        print(json.dumps(profile_one(cli.one[0], cli.one[1], cli)))
        return

    from trlx_scale.generation.vllm_server import ServerLaunch, VLLMServerProcess
    from trlx_scale.tasks import default_model_path

    results: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    launch = ServerLaunch(model=default_model_path(), dtype="float32", enable_lora=False)
    with VLLMServerProcess(launch, startup_timeout=600) as server:
        for repeat in range(cli.repeats):
            for kind in ("sync", "async"):
                env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
                env.update(TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1")
                if kind == "async":
                    env["OMP_WAIT_POLICY"] = "PASSIVE"  # as benchmarks/async_grpo.py --server runs it
                command = [sys.executable, os.path.abspath(__file__), "--one", kind, server.url]
                command += ["--steps", str(cli.steps), "--skip", str(cli.skip), "--seed", str(cli.seed + repeat)]
                command += ["--max-staleness", str(cli.max_staleness), "--samples-per-step", str(cli.samples_per_step)]
                done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
                if done.returncode != 0:
                    raise RuntimeError(f"{kind} failed:\n{done.stderr[-4000:]}")
                results[kind].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"repeat {repeat} {kind}: {results[kind][-1]}", file=sys.stderr)
    print(
        f"CPU seconds per step (steps {cli.skip + 1}..{cli.steps}, {cli.samples_per_step} samples, "
        f"max_staleness={cli.max_staleness}, no reward latency), medians of {cli.repeats}"
    )
    keys = list(results["sync"][0])
    print("| | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for kind in ("sync", "async"):
        row = [statistics.median(run[key] for run in results[kind]) for key in keys]
        print(f"| {kind} | " + " | ".join(f"{value:.3f}" for value in row) + " |")


if __name__ == "__main__":
    main()
