"""Asynchronous GRPO: how close overlapped generation and training come to max(generation, training) per step.

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
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from trlx_scale.rollout.async_producer import RolloutProducer, group_seed  # noqa: E402
from trlx_scale.rollout.simulated_engine import SimulatedEngine, lognormal_duration  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--simulated", action="store_true", help="the simulated engine and trainer (no model)")
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
    if not cli.simulated:
        parser.error("this version measures the simulated engine only: pass --simulated")

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
