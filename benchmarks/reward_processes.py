"""Synchronous reward functions in worker processes (``AsyncGRPOConfig.async_reward_processes``) against threads,
with a reward that computes in Python (benchmarks/cpu_reward.py: ``--work`` iterations of integer arithmetic per
completion, the GIL held throughout), on a real vLLM server with the embedded model and task.

Side by side in one run, interleaved within each repeat, each run in a process of its own (as in
``benchmarks/async_grpo.py --server``, whose runner this uses: 128 samples per step, LoRA r64, steps 3..N timed):
``GRPOTrainer`` (colocated engine; the reward on the trainer's thread), ``AsyncGRPOTrainer`` with the reward in the
producer's threads (``async_reward_processes=0``, the default), and with it in N worker processes for each N of
``--processes``. Reported: samples per second, medians of ``--repeats``, and the ratio to each of the other two.

    python benchmarks/reward_processes.py --repeats 3 --work 20000 --processes 1

Results and the command: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))


def _one_run(kind: str, processes: int, url: str, seed: int, workdir: str, cli) -> float:
    """In this process: one run's samples per second (``kind``: "sync" or "async")."""
    import functools

    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))
    from async_grpo import run_server_config
    from cpu_reward import python_verifier

    runner_cli = SimpleNamespace(samples_per_step=cli.samples_per_step, server_steps=cli.steps)
    reward = functools.partial(python_verifier, work=cli.work)
    overrides = {"async_reward_processes": processes} if kind == "async" else None
    return run_server_config(
        runner_cli,
        kind,
        cli.staleness,
        0.0,
        url,
        seed,
        os.path.join(workdir, f"{kind}-{processes}"),
        (),
        reward,
        overrides,
    )


def _in_subprocess(kind: str, processes: int, url: str, seed: int, workdir: str, cli) -> float:
    # Thread settings as in benchmarks/async_grpo.py: the asynchronous trainer's OpenMP threads sleep instead of
    # spinning (it shares the cores with the server), the synchronous one keeps OpenMP's default.
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    env.update(TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1")
    if kind == "async":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    command = [sys.executable, os.path.abspath(__file__), "--one", kind, str(processes), url, str(seed), workdir]
    command += ["--work", str(cli.work), "--steps", str(cli.steps), "--staleness", str(cli.staleness)]
    command += ["--samples-per-step", str(cli.samples_per_step)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} processes={processes} failed:\n{done.stderr[-4000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=int, default=20000, help="iterations of Python arithmetic per completion")
    parser.add_argument("--processes", type=int, nargs="+", default=[1], help="async_reward_processes to compare")
    parser.add_argument("--staleness", type=int, default=2, help="the asynchronous runs' max_staleness")
    parser.add_argument("--steps", type=int, default=12, help="steps of each run (3..N timed)")
    parser.add_argument("--samples-per-step", type=int, default=128)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--one", nargs=5, default=None, help=argparse.SUPPRESS)  # internal: one run
    cli = parser.parse_args()
    if any(n < 1 for n in cli.processes):
        parser.error("--processes: numbers of worker processes, each at least 1 (threads always run, as the baseline)")
    if cli.one:
        kind, processes, url, seed, workdir = cli.one
        print(_one_run(kind, int(processes), url, int(seed), workdir, cli))
        return

    sys.path.insert(0, os.path.dirname(HERE))
    from trlx_scale.generation.vllm_server import ServerLaunch, VLLMServerProcess
    from trlx_scale.tasks import default_model_path

    settings = [("sync", 0), ("async", 0)] + [("async", n) for n in cli.processes]
    results: dict[tuple, list[float]] = {}
    launch = ServerLaunch(model=default_model_path(), dtype="float32", enable_lora=False)  # as the trainer starts it
    with VLLMServerProcess(launch, startup_timeout=600) as server, tempfile.TemporaryDirectory() as workdir:
        for repeat in range(cli.repeats):
            for kind, processes in settings:  # interleaved: the machine's noise falls on every setting alike
                rate = _in_subprocess(kind, processes, server.url, cli.seed + repeat, workdir, cli)
                results.setdefault((kind, processes), []).append(rate)
                print(f"repeat {repeat} {kind} processes={processes}: {rate:.1f} samples/s", file=sys.stderr)
    sync = statistics.median(results[("sync", 0)])
    threads = statistics.median(results[("async", 0)])
    print(
        f"reward: {cli.work} iterations of Python arithmetic per completion; {cli.samples_per_step} samples/step, "
        f"{cli.steps} steps (3..N timed), async max_staleness {cli.staleness}; medians of {cli.repeats}"
    )
    print("| trainer | reward runs in | samples/s (runs) | vs GRPOTrainer | vs async threads |")
    print("|---|---|---|---|---|")
    for kind, processes in settings:
        runs = results[(kind, processes)]
        rate = statistics.median(runs)
        label = "GRPOTrainer (colocated)" if kind == "sync" else "AsyncGRPOTrainer"
        where = (
            "the trainer's thread"
            if kind == "sync"
            else ("the producer's threads" if processes == 0 else f"{processes} worker process(es)")
        )
        shown = ", ".join(f"{run:.1f}" for run in runs)
        print(f"| {label} | {where} | {rate:.1f} ({shown}) | {rate / sync:.2f}x | {rate / threads:.2f}x |")


if __name__ == "__main__":
    main()
