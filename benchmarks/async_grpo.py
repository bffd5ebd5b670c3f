"""Asynchronous GRPO against synchronous GRPO: throughput on a real vLLM server, the simulated bound, learning.

``--server``: side by side in one run, interleaved within each repeat, on this machine with the embedded model and
task: ``GRPOTrainer`` (vLLM colocated, fp32 engine) and ``AsyncGRPOTrainer`` at ``max_staleness`` 1, 2, 4 on one
real ``vllm serve`` subprocess (started once, outside the timing), each with a reward function of
``--reward-latency`` seconds per call (an async function sleeping that long: a remote verifier or a code sandbox)
and with none. Reported: samples per second over steps 3..N (start-up excluded), medians of ``--repeats``, and the
ratio to synchronous.

    python benchmarks/async_grpo.py --server --repeats 3

``--processes N`` runs each setting under ``accelerate launch`` with N training processes
(configs/accelerate/cpu_ddp.yaml), each training ``--samples-per-step`` a step; ``--weight-delivery`` lists the
``AsyncGRPOConfig.weight_delivery`` modes to compare, interleaved:

    python benchmarks/async_grpo.py --server --processes 2 --weight-delivery inline background --reward-latency 0

``--learning``: held-out accuracy of the embedded task after the same number of samples (``--learning-steps``
steps of the example's 128 samples) at ``max_staleness`` 0, 1, 4 with the off-policy correction on and off, and
synchronous ``GRPOTrainer``; seeds ``--seeds``; the example's settings otherwise.

    python benchmarks/async_grpo.py --learning --seeds 42 1 2

``--simulated`` (what this version measures): the real ``RolloutProducer`` (trlx_scale/rollout/async_producer.py)
drives a simulated engine (trlx_scale/rollout/simulated_engine.py: ``--slots`` groups at once, each occupying its
slot for a log-normal time with mean ``--mean-group-time`` and ``--sigma``) and a simulated trainer (takes a step's
groups, sleeps ``--train-time``, publishes the next version). Side by side in one run, interleaved within each repeat:
``max_staleness`` 0 (synchronous: a step's groups start once the weights that train them exist, and the step waits
for its slowest group) and ``max_staleness`` 1, 2, 4.

The bound of a step is max(generation, training): generation = the step's group times summed over the slots (the
engine busy on every slot), training = ``--train-time``. A run that buffers across steps can beat the mean of the
per-step bounds, never the run's bound max(mean generation, training), which is the stricter one. Reported per
setting: the median seconds per step, both bounds, bound / achieved for each (1.0 = the bound reached), the speed-up
over synchronous, the staleness seen, and the trainer's and the generator's idle fractions. Medians of
``--repeats``.

    python benchmarks/async_grpo.py --simulated --repeats 5

Results and the command: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from tests.helpers.simulated_engine import SimulatedEngine, lognormal_duration  # noqa: E402
from trlx_scale.rollout.async_producer import RolloutProducer, group_seed  # noqa: E402
from trlx_scale.rollout.staleness import StalenessSchedule  # noqa: E402


async def _no_reward(request, sampled):
    return [[0.0] for _ in sampled.completion_ids]


def run_simulated(cli: argparse.Namespace, max_staleness: int, seed: int) -> dict[str, float]:
    """One simulated run; returns seconds per step (after the first, which no run can overlap) and the metrics."""
    engine = SimulatedEngine(slots=cli.slots, mean_group_time=cli.mean_group_time, sigma=cli.sigma)
    schedule = StalenessSchedule(groups_per_version=cli.groups_per_step, max_staleness=max_staleness)
    producer = RolloutProducer(
        prompt_for=lambda index: index,
        sampler=engine,
        score=_no_reward,
        schedule=schedule,
        num_generations=8,
        seed=seed,
        max_inflight_tasks=cli.slots * (max_staleness + 1),
        queue_maxsize=cli.groups_per_step * (max_staleness + 1),
    )
    producer.start()
    step_ends, staleness, trainer_idle, generator_idle = [], [], [], []
    try:
        engine.publish(0)
        producer.publish_version(0)
        began = time.monotonic()
        for step in range(cli.steps):
            groups = producer.take(cli.groups_per_step, timeout=600)
            staleness.extend(group.staleness for group in groups)
            time.sleep(cli.train_time)
            engine.publish(step + 1)
            producer.publish_version(step + 1)
            step_ends.append(time.monotonic() - began)
            metrics = producer.pop_metrics()
            if step > 0:
                trainer_idle.append(metrics["async/trainer_idle_frac"])
                generator_idle.append(metrics["async/generator_idle_frac"])
    finally:
        producer.close()
    # The bound of each step: its groups' slot time spread over the slots, or the training time.
    bounds, generation_times = [], []
    for step in range(1, cli.steps):
        indices = range(step * cli.groups_per_step, (step + 1) * cli.groups_per_step)
        generation = sum(
            lognormal_duration(group_seed(seed, schedule.sampled_at(k), k), cli.mean_group_time, cli.sigma)
            for k in indices
        )
        generation_times.append(generation / cli.slots)
        bounds.append(max(generation / cli.slots, cli.train_time))
    per_step = (step_ends[-1] - step_ends[0]) / (cli.steps - 1)
    return {
        "s_per_step": per_step,
        "bound_s_per_step": sum(bounds) / len(bounds),
        # The run's bound: generation and training totals, each spread over the steps (buffering across steps lets
        # a run beat the per-step bound; never this one).
        "run_bound_s_per_step": max(statistics.mean(generation_times), cli.train_time),
        "staleness_mean": statistics.mean(staleness),
        "staleness_max": max(staleness),
        "trainer_idle_frac": statistics.mean(trainer_idle),
        "generator_idle_frac": statistics.mean(generator_idle),
    }


def _latency_reward(latency: float):
    """Exact match, after ``latency`` seconds per call (an async function: a remote verifier's round trip)."""
    from trlx_scale.tasks import exact_match_reward

    async def remote_verifier(completions, answer, **kwargs):
        await asyncio.sleep(latency)
        return exact_match_reward(completions, answer=answer)

    return remote_verifier if latency > 0 else exact_match_reward


class _StepClock:
    def __init__(self):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                clock.ends.append(time.monotonic())

        self.ends: list[float] = []
        self.callback = Callback()


def run_server_config(
    cli,
    kind: str,
    max_staleness: int,
    latency: float,
    url: str,
    seed: int,
    workdir: str,
    callbacks=(),
    reward=None,
    async_overrides=None,
) -> float:
    """Samples per second over steps 3..N of one run (``kind``: "sync" or "async"); ``callbacks``: more trainer
    callbacks (benchmarks/async_cpu_profile.py); ``reward``: the reward function instead of ``latency``'s,
    ``async_overrides``: more AsyncGRPOConfig fields (benchmarks/reward_processes.py)."""
    from peft import LoraConfig

    from trlx_scale import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig, GRPOTrainer
    from trlx_scale.tasks import addition_dataset, default_model_path

    world = int(os.environ.get("WORLD_SIZE", "1"))  # --processes: each rank trains samples_per_step a step
    launched = dict(use_cpu=True, ddp_backend="gloo") if world > 1 else {}  # as the examples do on CPU
    common = dict(
        **launched,
        output_dir=os.path.join(workdir, f"{kind}-{max_staleness}-{latency}"),
        per_device_train_batch_size=cli.samples_per_step,
        num_generations=8,
        max_completion_length=6,
        max_steps=cli.server_steps,
        learning_rate=5e-4,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        seed=seed,
        disable_tqdm=True,
    )
    if kind == "sync":
        args = GRPOConfig(**common, use_vllm=True, vllm_mode="colocate", vllm_dtype="trainer")
        trainer_cls = GRPOTrainer
    else:
        args = AsyncGRPOConfig(
            **common, max_staleness=max_staleness, vllm_server_base_url=url, **(async_overrides or {})
        )
        trainer_cls = AsyncGRPOTrainer
    # The example's policy: the embedded model through a rank-64 LoRA on every linear layer.
    lora = LoraConfig(
        r=64,
        lora_alpha=128,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    trainer = trainer_cls(
        model=default_model_path(),
        reward_funcs=reward if reward is not None else _latency_reward(latency),
        args=args,
        train_dataset=addition_dataset("train", size=4096),
        peft_config=lora,
    )
    clock = _StepClock()
    trainer.add_callback(clock.callback)
    for callback in callbacks:
        trainer.add_callback(callback)
    trainer.train()
    ends = clock.ends
    del trainer
    gc.collect()
    return world * cli.samples_per_step * (len(ends) - 3) / (ends[-1] - ends[2])


def _run_in_subprocess(cli, kind, staleness, latency, url, seed, workdir, delivery="inline") -> float:
    """One setting in a process of its own, each trainer with its own best thread setting: the asynchronous one
    with OpenMP threads that sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``, what its example sets: on CPU
    it shares the cores with the server), the synchronous one with OpenMP's default (it has the cores to itself)."""
    import subprocess

    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    env.update(TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1")
    if kind == "async":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    launcher = [sys.executable]
    if cli.processes > 1:  # under accelerate launch, as a user runs it (configs/accelerate/cpu_ddp.yaml)
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "accelerate")
        launcher += ["-m", "accelerate.commands.launch", "--config_file", os.path.join(config, "cpu_ddp.yaml")]
        launcher += ["--num_processes", str(cli.processes), "--main_process_port", str(port)]
    command = [*launcher, os.path.abspath(__file__), "--one-server-config", kind, str(staleness), str(latency)]
    command += [url, str(seed), workdir, "--server-steps", str(cli.server_steps)]
    command += ["--samples-per-step", str(cli.samples_per_step), "--weight-delivery", delivery]
    command += ["--processes", str(cli.processes)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} s={staleness} latency={latency} failed:\n{done.stderr[-4000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def run_server(cli) -> None:
    import tempfile

    from trlx_scale.generation.vllm_server import ServerLaunch, VLLMServerProcess
    from trlx_scale.tasks import default_model_path

    # Each asynchronous setting once per --weight-delivery mode (named in the table when there are several).
    settings = [("sync", 0, "inline")] + [
        ("async", s, delivery) for s in cli.staleness if s > 0 for delivery in cli.weight_delivery
    ]
    results: dict[tuple, list[float]] = {}
    # The server the trainer starts itself here: on CPU it sends merged full weights (vllm_sync_mode "auto"), so
    # no adapter slots, which slow the CPU engine's sampling.
    launch = ServerLaunch(model=default_model_path(), dtype="float32", enable_lora=False)
    with VLLMServerProcess(launch, startup_timeout=600) as server, tempfile.TemporaryDirectory() as workdir:
        for repeat in range(cli.repeats):
            for latency in cli.reward_latency:
                for kind, staleness, delivery in settings:  # interleaved: the noise falls on every setting alike
                    seed = cli.seed + repeat
                    rate = _run_in_subprocess(cli, kind, staleness, latency, server.url, seed, workdir, delivery)
                    results.setdefault((latency, kind, staleness, delivery), []).append(rate)
                    print(
                        f"repeat {repeat} latency {latency} {kind} s={staleness} {delivery}: {rate:.1f} samples/s",
                        file=sys.stderr,
                    )
    print(
        f"server: embedded model, LoRA r64, {cli.samples_per_step} samples/step (G=8) on each of {cli.processes} "
        f"training process(es), {cli.server_steps} steps (3..N timed), medians of {cli.repeats}"
    )
    several = len(cli.weight_delivery) > 1
    print(
        "| reward latency | trainer | max_staleness |"
        + (" weight_delivery |" if several else "")
        + " samples/s, median (per repeat) | vs sync: median of the per-repeat ratios (per repeat) |"
    )
    print("|---|---|---|" + ("---|" if several else "") + "---|---|")
    summary = {}
    for latency in cli.reward_latency:
        syncs = results[(latency, "sync", 0, "inline")]
        for kind, staleness, delivery in settings:
            rates = results[(latency, kind, staleness, delivery)]
            ratios = [rate / sync for rate, sync in zip(rates, syncs, strict=True)]
            rate = statistics.median(rates)
            summary[f"{latency}|{kind}|{staleness}|{delivery}"] = rate
            label = "GRPOTrainer (colocated)" if kind == "sync" else "AsyncGRPOTrainer"
            shown = "-" if kind == "sync" else staleness
            print(
                f"| {latency} s | {label} | {shown} |"
                + ((" - |" if kind == "sync" else f" {delivery} |") if several else "")
                + f" {rate:.1f} ({', '.join(f'{r:.1f}' for r in rates)}) |"
                + f" {statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)}) |"
            )
    if cli.json_out:
        with open(cli.json_out, "w") as handle:
            raw = {"|".join(map(str, key)): value for key, value in results.items()}
            json.dump({"args": vars(cli), "summary": summary, "runs": raw}, handle, indent=1)


def _learning_setting(text: str) -> tuple[str, int, bool, str | None]:
    """'sync', or 'async:S:on' / 'async:S:off' (max_staleness S, the correction on or off), optionally ':MODE' (the
    correction's vllm_importance_sampling_mode; unset: AsyncGRPOConfig's default)."""
    if text == "sync":
        return ("sync", 0, True, None)
    parts = text.split(":")
    if len(parts) not in (3, 4) or parts[0] != "async" or parts[2] not in ("on", "off"):
        raise ValueError(f"--learning-settings: {text!r} is not 'sync' or 'async:S:on|off[:MODE]'.")
    return ("async", int(parts[1]), parts[2] == "on", parts[3] if len(parts) == 4 else None)


def run_learning(cli) -> None:
    """Each setting through the examples (subprocesses): held-out accuracy after the same samples."""
    import subprocess
    import tempfile

    from trlx_scale.generation.vllm_server import ServerLaunch, VLLMServerProcess
    from trlx_scale.tasks import default_model_path

    root = os.path.dirname(HERE)
    settings = [_learning_setting(text) for text in cli.learning_settings]
    results: dict[tuple, list[float]] = {}
    launch = ServerLaunch(model=default_model_path(), dtype="float32", max_loras=6)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1")
    with VLLMServerProcess(launch, startup_timeout=600) as server, tempfile.TemporaryDirectory() as workdir:
        for seed in cli.seeds:
            for kind, staleness, correction, mode in settings:
                out = os.path.join(workdir, f"{kind}-{staleness}-{correction}-{mode}-{seed}")
                script = os.path.join(root, "examples", "grpo.py" if kind == "sync" else "async_grpo.py")
                command = [sys.executable, script, "--seed", str(seed), "--max_steps", str(cli.learning_steps)]
                command += ["--output_dir", out, "--eval_every_steps", "0", "--eval_size", str(cli.eval_size)]
                if kind == "async":
                    command += ["--max_staleness", str(staleness), "--vllm_server_base_url", server.url]
                    command += ["--vllm_importance_sampling_correction", str(correction)]
                    if mode is not None:
                        command += ["--vllm_importance_sampling_mode", mode]
                done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
                if done.returncode != 0:
                    raise RuntimeError(f"{command} failed:\n{done.stderr[-3000:]}")
                with open(os.path.join(out, "run_summary.json")) as handle:
                    summary = json.load(handle)
                gain = 100 * (summary["accuracy_after"] - summary["accuracy_before"])
                results.setdefault((kind, staleness, correction, mode), []).append(100 * summary["accuracy_after"])
                print(
                    f"seed {seed} {kind} s={staleness} correction={correction} mode={mode or 'default'}: after "
                    f"{100 * summary['accuracy_after']:.1f}% (gain {gain:+.1f})",
                    file=sys.stderr,
                )
    print(
        f"learning: embedded task, {cli.learning_steps} steps x 128 samples, seeds {cli.seeds}, "
        f"eval_size {cli.eval_size or 'the whole held-out split'}"
    )
    print(
        "| trainer | max_staleness | correction | held-out accuracy after (per seed) | median | mean | vs sync "
        "(medians) | per-seed difference to sync (mean) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    sync_values = results[("sync", 0, True, None)]
    sync = statistics.median(sync_values)
    for kind, staleness, correction, mode in settings:
        values = results[(kind, staleness, correction, mode)]
        label = "GRPOTrainer (colocated)" if kind == "sync" else "AsyncGRPOTrainer"
        median = statistics.median(values)
        differences = [value - base for value, base in zip(values, sync_values, strict=True)]
        shown = (
            "-"
            if kind == "sync"
            else f"{', '.join(f'{d:+.1f}' for d in differences)} ({statistics.mean(differences):+.1f})"
        )
        print(
            f"| {label} | {'-' if kind == 'sync' else staleness} | {'on' if correction else 'off'}"
            f"{'' if mode is None else ' (' + mode + ')'} | "
            f"{', '.join(f'{v:.1f}' for v in values)} | {median:.1f}% | {statistics.mean(values):.1f}% | "
            f"{median - sync:+.1f} | {shown} |"
        )
    if cli.json_out:
        with open(cli.json_out, "w") as handle:
            json.dump({"args": vars(cli), "runs": {"|".join(map(str, k)): v for k, v in results.items()}}, handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--simulated", action="store_true", help="the simulated engine and trainer (no model)")
    parser.add_argument("--server", action="store_true", help="sync vs async on a real vLLM server (embedded model)")
    parser.add_argument("--learning", action="store_true", help="held-out accuracy after the same samples")
    parser.add_argument("--reward-latency", type=float, nargs="+", default=[0.0, 1.0], help="seconds per call")
    parser.add_argument("--samples-per-step", type=int, default=128)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1])
    parser.add_argument("--learning-steps", type=int, default=200)
    parser.add_argument(
        "--eval-size",
        type=int,
        default=0,
        help="held-out prompts scored after each --learning run (0: the whole held-out split, 2000 prompts: a "
        "binomial standard error of about 1.1 points, against 2 at the example's 600)",
    )
    parser.add_argument(
        "--learning-settings",
        nargs="+",
        default=["sync", "async:0:on", "async:1:on", "async:1:off", "async:4:on", "async:4:off"],
        help="the --learning runs: 'sync', or 'async:S:on|off[:MODE]' (max_staleness S, the correction on or off, "
        "optionally its vllm_importance_sampling_mode)",
    )
    parser.add_argument("--server-steps", type=int, default=12, help="steps of each --server run (3..N timed)")
    parser.add_argument(
        "--weight-delivery",
        nargs="+",
        default=["auto"],
        choices=["auto", "background", "inline"],
        help="--server: each asynchronous setting once per AsyncGRPOConfig.weight_delivery mode listed (default: "
        "the config's default, auto: background with one process and full weights)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="--server: training processes of each run (accelerate launch with configs/accelerate/cpu_ddp.yaml; "
        "each trains --samples-per-step a step, the synchronous ones each with its colocated engine)",
    )
    parser.add_argument("--one-server-config", nargs=6, default=None, help=argparse.SUPPRESS)  # internal
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--groups-per-step", type=int, default=8)
    parser.add_argument("--slots", type=int, default=8, help="groups the simulated engine runs at once")
    parser.add_argument("--mean-group-time", type=float, default=0.1, help="seconds a group occupies a slot, mean")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the group times")
    parser.add_argument("--train-time", type=float, default=0.1, help="seconds of one simulated training step")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--json-out", default=None)
    cli = parser.parse_args()
    if cli.one_server_config:
        kind, staleness, latency, url, seed, workdir = cli.one_server_config
        overrides = {"weight_delivery": cli.weight_delivery[0]} if kind == "async" else None
        rate = run_server_config(
            cli, kind, int(staleness), float(latency), url, int(seed), workdir, async_overrides=overrides
        )
        if int(os.environ.get("RANK", "0")) == 0:  # the whole run's samples per second, once
            print(rate)
        return
    if cli.server:
        run_server(cli)
        return
    if cli.learning:
        run_learning(cli)
        return
    if not cli.simulated:
        parser.error("pass --simulated, --server or --learning")

    runs: dict[int, list[dict[str, float]]] = {s: [] for s in cli.staleness}
    for repeat in range(cli.repeats):
        for max_staleness in cli.staleness:  # interleaved: the machine's noise falls on every setting alike
            runs[max_staleness].append(run_simulated(cli, max_staleness, seed=repeat))
            print(f"repeat {repeat} max_staleness {max_staleness}: {runs[max_staleness][-1]}", file=sys.stderr)

    def median(s: int, key: str) -> float:
        return statistics.median(run[key] for run in runs[s])

    sync = median(cli.staleness[0], "s_per_step")
    print(
        f"simulated: {cli.groups_per_step} groups/step on {cli.slots} slots, group time log-normal mean "
        f"{cli.mean_group_time} s sigma {cli.sigma}, training {cli.train_time} s/step, {cli.steps} steps, "
        f"medians of {cli.repeats}"
    )
    print(
        "| max_staleness | s/step | per-step bound | run bound | per-step bound / achieved | run bound / achieved "
        "| vs s=0 | staleness mean/max | trainer idle | generator idle |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for s in cli.staleness:
        row = {key: median(s, key) for key in runs[s][0]}
        row["bound_over_achieved"] = statistics.median(run["bound_s_per_step"] / run["s_per_step"] for run in runs[s])
        row["run_bound_over_achieved"] = statistics.median(
            run["run_bound_s_per_step"] / run["s_per_step"] for run in runs[s]
        )
        summary[s] = row
        print(
            f"| {s} | {row['s_per_step']:.3f} | {row['bound_s_per_step']:.3f} | {row['run_bound_s_per_step']:.3f} | "
            f"{row['bound_over_achieved']:.2f} | {row['run_bound_over_achieved']:.2f} | "
            f"{sync / row['s_per_step']:.2f}x | {row['staleness_mean']:.2f} / {row['staleness_max']:.0f} | "
            f"{row['trainer_idle_frac']:.2f} | {row['generator_idle_frac']:.2f} |"
        )
    if cli.json_out:
        with open(cli.json_out, "w") as handle:
            json.dump({"args": vars(cli), "summary": summary, "runs": runs}, handle, indent=1)


if __name__ == "__main__":
    main()
