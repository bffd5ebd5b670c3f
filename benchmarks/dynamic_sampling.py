"""Dynamic sampling on the embedded tasks: held-out accuracy against training time and against generated tokens, with
and without, over several seeds.

Tasks (``--task``): ``addition``, the README's run (``make run``: ``examples/grpo.py``); ``calculator_tools``, the
agentic task (``examples/grpo_tools.py``: the embedded tool model with ``tools=[add]``, its defaults from
``trlx_scale.tasks.calculator_tool_run``, held-out accuracy every 5 steps). Trainers (``--trainer``): ``grpo``
(colocated vLLM) or ``async_grpo`` (``AsyncGRPOTrainer`` on a vLLM server it starts, the example's
``max_staleness``: 0 on the calculator task, where 1 was measured unstable, docs/benchmarks_archive.md).

Variants (each a whole run in its own process, the order rotated per seed so that no variant always runs first):

- ``off``: the README's run (``dynamic_sampling=False``);
- ``dynamic``: ``dynamic_sampling=True`` with its defaults (over-sampling in the first engine call by the learnt
  factor, carried-over groups, at most 3 rounds);
- ``until_full``: verl's "generate until full": no over-sampling, nothing carried over, up to 8 rounds a step.

``until_full`` is ``GRPOTrainer``'s (the asynchronous producer replaces each group as it is scored: no rounds).

Per run: held-out accuracy before and after (and at every ``eval_every_steps``), training seconds (the held-out
scoring excluded, as the run summary counts them), generated tokens (TRL's ``num_tokens``: prompt and completion
tokens of every generation call; with the async trainer plus the tokens of the groups its producer dropped),
generation seconds and rounds per step. Medians over seeds; then each variant's
accuracy at the training time (and the generated tokens) of the run without: its last accuracy point reached by
then (no interpolation), against the run without's final one.

    python benchmarks/dynamic_sampling.py --seeds 1 2 3 [--steps 200] [--out outputs/bench-dynamic-sampling]
    python benchmarks/dynamic_sampling.py --task calculator_tools --variants off dynamic --seeds 1 2 3
    python benchmarks/dynamic_sampling.py --task calculator_tools --trainer async_grpo --variants off dynamic
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "off": [],
    "dynamic": ["--dynamic_sampling", "true"],
    "until_full": [
        "--dynamic_sampling",
        "true",
        "--dynamic_sampling_max_oversample",
        "1",
        "--dynamic_sampling_max_carry",
        "0",
        "--dynamic_sampling_max_rounds",
        "8",
    ],
}


EXAMPLES = {"grpo": "grpo.py", "async_grpo": "async_grpo.py"}
TASK_FLAGS = {
    "addition": [],
    # Every 5 steps: the curve that accuracy at the same training time is read from (the task's run is 30 steps).
    "calculator_tools": ["--task", "calculator_tools", "--eval_every_steps", "5", "--logging_steps", "1"],
}


def dropped_tokens(logs: list[dict]) -> float:
    """The tokens of the groups AsyncGRPOTrainer's producer dropped (``batch/dropped_tokens``, each logged value the
    mean over its logging window): generated but never trained, so not in TRL's ``num_tokens``, which counts the
    tokens of the generation calls (GRPOTrainer's dropped groups included; the async trainer's calls return the
    trained groups only). 0 for GRPOTrainer, which does not log it."""
    total, previous = 0.0, 0
    for entry in sorted(logs, key=lambda entry: entry["step"]):
        total += entry.get("batch/dropped_tokens", 0.0) * (entry["step"] - previous)
        previous = entry["step"]
    return total


def run(variant: str, seed: int, steps: int | None, out: str, task: str = "addition", trainer: str = "grpo") -> dict:
    output_dir = os.path.join(out, f"{task}-{trainer}-{variant}-seed{seed}")
    command = [sys.executable, os.path.join(REPO_ROOT, "examples", EXAMPLES[trainer]), "--seed", str(seed)]
    command += ["--output_dir", output_dir, "--report_to", "none", *TASK_FLAGS[task]]
    command += VARIANTS[variant]
    if steps is not None:
        command += ["--max_steps", str(steps)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{variant} seed {seed} failed:\n{result.stderr[-4000:]}")
    with open(os.path.join(output_dir, "run_summary.json")) as handle:
        summary = json.load(handle)
    with open(os.path.join(output_dir, "trainer_state.json")) as handle:
        logs = [entry for entry in json.load(handle)["log_history"] if "loss" in entry]

    def mean_of(key: str) -> float | None:
        values = [entry[key] for entry in logs if key in entry]
        return statistics.fmean(values) if values else None

    return {
        "task": task,
        "trainer": trainer,
        "variant": variant,
        "seed": seed,
        "steps": summary["steps"],
        "accuracy_before": summary["accuracy_before"],
        "accuracy_after": summary["accuracy_after"],
        "accuracy_curve": summary["accuracy_curve"],
        "train_seconds": summary["train_seconds"],
        "generated_tokens": max(entry.get("num_tokens", 0) for entry in logs) + dropped_tokens(logs),
        "generation_seconds_per_step": mean_of("time/generation"),
        "rounds_per_step": mean_of("batch/generation_rounds") or 1.0,
        "zero_variance_frac": mean_of("batch/zero_variance_frac") or mean_of("frac_reward_zero_std"),
        "filled_frac": mean_of("batch/filled_frac"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=None, help="max_steps (unset: the README's run)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--task", default="addition", choices=list(TASK_FLAGS))
    parser.add_argument(
        "--reach", type=float, nargs="*", default=[0.95, 0.99], help="held-out accuracies to time the first reach of"
    )
    parser.add_argument("--trainer", default="grpo", choices=list(EXAMPLES))
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "outputs", "bench-dynamic-sampling"))
    parser.add_argument("--tables_from", default=None, help="a results JSON of an earlier run: print its tables only")
    cli = parser.parse_args()
    if cli.tables_from is not None:
        with open(cli.tables_from) as handle:
            results = json.load(handle)
        variants = list(dict.fromkeys(r["variant"] for r in results))
        print_tables(results, variants, cli.reach)
        return
    if cli.trainer == "async_grpo" and "until_full" in cli.variants:
        parser.error("until_full is GRPOTrainer's: the asynchronous producer has no rounds (--variants off dynamic).")
    results = []
    for index, seed in enumerate(cli.seeds):
        order = cli.variants[index % len(cli.variants) :] + cli.variants[: index % len(cli.variants)]
        for variant in order:
            results.append(run(variant, seed, cli.steps, cli.out, cli.task, cli.trainer))
            print(json.dumps(results[-1]), flush=True)
    with open(os.path.join(cli.out, f"results-{cli.task}-{cli.trainer}.json"), "w") as handle:
        json.dump(results, handle, indent=1)
    print_tables(results, cli.variants, cli.reach)


def print_tables(results: list[dict], variants: list[str], reach: list[float]) -> None:
    print(
        "\n| variant | held-out accuracy after (median; per seed) | train s | generated tokens | generation s/step "
        "| rounds/step | zero-variance groups | filled |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for variant in variants:
        rows = [r for r in results if r["variant"] == variant]

        def med(key: str, rows: list = rows) -> float:
            return statistics.median(r[key] for r in rows if r[key] is not None)

        per_seed = ", ".join(f"{r['accuracy_after']:.3f}" for r in rows)
        filled = [r["filled_frac"] for r in rows if r["filled_frac"] is not None]
        print(
            f"| {variant} | {med('accuracy_after'):.3f} ({per_seed}) | {med('train_seconds'):.1f} | "
            f"{med('generated_tokens'):.0f} | {med('generation_seconds_per_step'):.3f} | {med('rounds_per_step'):.2f} | "
            f"{med('zero_variance_frac'):.2f} | {statistics.median(filled) if filled else '-'} |"
        )
    if "off" in variants:
        print_same_budget(results, variants)
    print_time_to_reach(results, variants, reach)


def accuracy_by(result: dict, budget: float, key: str) -> float:
    """The run's last held-out accuracy point reached within ``budget`` of ``key`` ("train_seconds" or
    "generated_tokens"), each point's share of the total taken as its share of the steps (no interpolation)."""
    reached = result["accuracy_before"]
    for step, accuracy in result["accuracy_curve"]:
        if step * result[key] / result["steps"] <= budget * (1 + 1e-9):
            reached = accuracy
    return reached


def first_reach(result: dict, accuracy: float, key: str) -> float | None:
    """The training seconds or generated tokens (``key``) at the first curve point with held-out accuracy at least
    ``accuracy`` (None: never reached)."""
    for step, reached in result["accuracy_curve"]:
        if reached >= accuracy:
            return step * result[key] / result["steps"]
    return None


def print_time_to_reach(results: list[dict], variants: list[str], targets: list[float]) -> None:
    """Per variant and target accuracy: the training seconds and generated tokens to reach it, median and per seed."""
    print("\n| variant | target | train s to reach it (median; per seed) | generated tokens to reach it (median) |")
    print("|---|---|---|---|")
    for variant in variants:
        rows = [r for r in results if r["variant"] == variant]
        for target in targets:
            seconds = [first_reach(r, target, "train_seconds") for r in rows]
            tokens = [first_reach(r, target, "generated_tokens") for r in rows]
            reached = [value for value in seconds if value is not None]
            median = f"{statistics.median(reached):.1f}" if len(reached) == len(rows) else "not reached by every seed"
            per_seed = ", ".join("-" if value is None else f"{value:.1f}" for value in seconds)
            token_median = f"{statistics.median(tokens):.0f}" if all(value is not None for value in tokens) else "-"
            print(f"| {variant} | {target} | {median} ({per_seed}) | {token_median} |")


def print_same_budget(results: list[dict], variants: list[str]) -> None:
    """Each variant's accuracy at the run without's training time and generated tokens, seed by seed."""
    print("\n| variant | accuracy at off's training time (median; per seed) | at off's generated tokens | off's own |")
    print("|---|---|---|---|")
    offs = {r["seed"]: r for r in results if r["variant"] == "off"}
    for variant in variants:
        rows = [r for r in results if r["variant"] == variant and r["seed"] in offs]
        by_time = [accuracy_by(r, offs[r["seed"]]["train_seconds"], "train_seconds") for r in rows]
        by_tokens = [accuracy_by(r, offs[r["seed"]]["generated_tokens"], "generated_tokens") for r in rows]
        own = [offs[r["seed"]]["accuracy_after"] for r in rows]
        print(
            f"| {variant} | {statistics.median(by_time):.3f} ({', '.join(f'{a:.3f}' for a in by_time)}) | "
            f"{statistics.median(by_tokens):.3f} ({', '.join(f'{a:.3f}' for a in by_tokens)}) | "
            f"{statistics.median(own):.3f} ({', '.join(f'{a:.3f}' for a in own)}) |"
        )


if __name__ == "__main__":
    main()
