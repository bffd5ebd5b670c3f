"""Full-weight updates under asynchronous GRPO: requests in flight drained (``full_weight_reload="drain"``) against
kept in flight (``"keep"``), side by side in one run on one real vLLM server.

Each setting trains ``AsyncGRPOTrainer`` on the embedded model and task with full weights (no LoRA: every update is
a reload), ``--max-staleness`` and ``--max-completion-length`` (long completions: the requests a drained update
waits for), in a process of its own, the settings interleaved within each repeat. Reported, medians of
``--repeats``: samples per second over steps 3..N (start-up excluded), the seconds each update took on the trainer's
side (``sync/seconds``: for "drain" the wait for the requests in flight, the reload and the probe), and for "keep"
the share of sampled tokens an update reached inside their completion (``async/tokens_after_update_frac``).

    python benchmarks/full_weight_reload.py --repeats 3

Before the training runs, the mechanism alone (``--reload-repeats``): one long group in flight (128 samples of up to
200 tokens, about a second of the server's time here) and a reload of the same model's weights sent 50 ms after it,
through the client, in each mode: the seconds the reload took, and the seconds the group took.

Results and the command: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MODES = ("drain", "keep")


def run_one(cli, mode: str, url: str, seed: int, workdir: str) -> dict[str, float]:
    """One training run in this process; returns its rate and its logged update figures."""
    from transformers import TrainerCallback

    from trlx_scale import AsyncGRPOConfig, AsyncGRPOTrainer
    from trlx_scale.tasks import addition_dataset, default_model_path, exact_match_reward

    args = AsyncGRPOConfig(
        output_dir=os.path.join(workdir, f"{mode}-{seed}"),
        per_device_train_batch_size=cli.samples_per_step,
        num_generations=8,
        max_completion_length=cli.max_completion_length,
        temperature=cli.temperature,
        max_steps=cli.steps,
        learning_rate=5e-4,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        seed=seed,
        disable_tqdm=True,
        max_staleness=cli.max_staleness,
        vllm_server_base_url=url,
        vllm_sync_mode="full",
        full_weight_reload=mode,
    )
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    trainer = AsyncGRPOTrainer(
        model=default_model_path(),
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=addition_dataset("train", size=4096),
    )
    trainer.add_callback(Clock())
    trainer.train()
    history = trainer.state.log_history
    sync = [entry["sync/seconds"] for entry in history[2:] if "sync/seconds" in entry]
    share = [entry["async/tokens_after_update_frac"] for entry in history if "async/tokens_after_update_frac" in entry]
    return {
        "samples_per_s": cli.samples_per_step * (len(ends) - 3) / (ends[-1] - ends[2]),
        "sync_seconds": statistics.median(sync) if sync else float("nan"),
        "tokens_after_update": statistics.mean(share) if share else 0.0,
    }


def reload_latency(url: str, repeats: int, workdir: str) -> dict[str, dict[str, float]]:
    """The reload's and the group's seconds with one long group in flight, per mode (medians of ``repeats``)."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM

    from trlx_scale.generation.server_client import SamplingSettings, VLLMServerClient
    from trlx_scale.generation.server_weights import write_full_weights
    from trlx_scale.rollout.async_producer import GroupRequest
    from trlx_scale.tasks import default_model_path

    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    path = write_full_weights(model, os.path.join(workdir, "weights"))
    figures: dict[str, dict[str, list[float]]] = {mode: {"reload": [], "group": []} for mode in MODES}

    async def one(client) -> tuple[float, float]:
        try:
            began = time.perf_counter()
            request = GroupRequest(index=0, prompt=[1, 5, 6, 7], num_generations=128, version=0, seed=3)
            group = asyncio.create_task(client.sample(request))
            await asyncio.sleep(0.05)
            reload_began = time.perf_counter()
            await asyncio.to_thread(client.reload_weights, 0, path)
            reloaded = time.perf_counter() - reload_began
            await group
            return reloaded, time.perf_counter() - began
        finally:
            await client.aclose()

    for _ in range(repeats):
        for mode in MODES:
            client = VLLMServerClient(
                [url],
                model=default_model_path(),
                sampling=SamplingSettings(200),
                keep_requests_on_reload=mode == "keep",
            )
            reloaded, group = asyncio.run(one(client))
            figures[mode]["reload"].append(reloaded)
            figures[mode]["group"].append(group)
    return {mode: {key: statistics.median(values) for key, values in by.items()} for mode, by in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples-per-step", type=int, default=64)
    parser.add_argument("--max-completion-length", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--reload-repeats", type=int, default=5)
    parser.add_argument("--one", nargs=4, default=None, help=argparse.SUPPRESS)  # internal: mode url seed workdir
    parser.add_argument("--json-out", default=None)
    cli = parser.parse_args()
    if cli.one:
        mode, url, seed, workdir = cli.one
        print(json.dumps(run_one(cli, mode, url, int(seed), workdir)))
        return

    from trlx_scale.generation.vllm_server import ServerLaunch, VLLMServerProcess
    from trlx_scale.tasks import default_model_path

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1", OMP_WAIT_POLICY="PASSIVE")
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    launch = ServerLaunch(model=default_model_path(), dtype="float32", enable_lora=False)
    with VLLMServerProcess(launch, startup_timeout=600) as server, tempfile.TemporaryDirectory() as workdir:
        latency = reload_latency(server.url, cli.reload_repeats, workdir)
        print(f"reload with a long group in flight: {latency}", file=sys.stderr)
        for repeat in range(cli.repeats):
            for mode in MODES:  # interleaved: the machine's noise falls on both alike
                command = [sys.executable, os.path.abspath(__file__), "--one", mode, server.url]
                command += [str(cli.seed + repeat), workdir]
                for flag in ("steps", "samples_per_step", "max_completion_length", "temperature", "max_staleness"):
                    command += [f"--{flag.replace('_', '-')}", str(getattr(cli, flag))]
                done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
                if done.returncode != 0:
                    raise RuntimeError(f"{mode} failed:\n{done.stderr[-4000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                results[mode].append(result)
                print(f"repeat {repeat} {mode}: {result}", file=sys.stderr)
    print(
        f"full-weight reloads: embedded model, {cli.samples_per_step} samples/step (G=8), max_completion_length "
        f"{cli.max_completion_length}, max_staleness {cli.max_staleness}, {cli.steps} steps (3..N timed), medians of "
        f"{cli.repeats}"
    )
    print(
        f"One long group in flight (128 x up to 200 tokens), a reload 50 ms after it; medians of {cli.reload_repeats}"
    )
    print("| full_weight_reload | reload seconds | group seconds |")
    print("|---|---|---|")
    for mode in MODES:
        print(f"| {mode} | {latency[mode]['reload']:.3f} | {latency[mode]['group']:.3f} |")
    print()
    print("| full_weight_reload | samples/s | vs drain | update seconds (trainer side) | tokens after an update |")
    print("|---|---|---|---|---|")
    drain = statistics.median(run["samples_per_s"] for run in results["drain"])
    for mode in MODES:
        runs = results[mode]
        rate = statistics.median(run["samples_per_s"] for run in runs)
        sync = statistics.median(run["sync_seconds"] for run in runs)
        share = statistics.median(run["tokens_after_update"] for run in runs)
        print(f"| {mode} | {rate:.1f} | {rate / drain:.2f}x | {sync:.3f} | {100 * share:.1f}% |")
    if cli.json_out:
        with open(cli.json_out, "w") as handle:
            json.dump({"args": vars(cli), "reload": latency, "runs": results}, handle, indent=1)


if __name__ == "__main__":
    main()
