"""Reward scoring in the synchronous trainers: trlx_scale's scorer (``reward_scoring="concurrent"``) against TRL's
loop (``trl.GRPOTrainer``, and ``reward_scoring="sequential"``, which runs TRL's loop inside trlx_scale's trainer).

Same configuration for the three, side by side in one run, interleaved within each repeat: the embedded model and
task, 2 prompts x 4 samples per step, HF generation (no vLLM: the rollout's other parts alike), and
``--functions`` synchronous reward functions that each wait ``--latency`` seconds per call (a remote verifier, a
sandbox) and then score exact match. Reported: the median seconds per step over steps 2..N (the first excluded),
medians of ``--repeats``, and the ratio to TRL.

    python benchmarks/reward_scoring.py --repeats 3

Results and the command: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SETTINGS = ("trl", "sequential", "concurrent")


def _slow_reward(latency: float, index: int):
    from trlx_scale.tasks import exact_match_reward

    def reward(completions, answer, **kwargs):
        time.sleep(latency)
        return exact_match_reward(completions=completions, answer=answer)

    reward.__name__ = f"slow_reward_{index}"
    return reward


def run(setting: str, cli, workdir: str) -> float:
    import trl
    from transformers import TrainerCallback

    from trlx_scale import GRPOConfig, GRPOTrainer
    from trlx_scale.tasks import addition_dataset, default_model_path

    common = dict(
        output_dir=os.path.join(workdir, setting),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=5,
        max_steps=cli.steps,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        seed=7,
        disable_tqdm=True,
    )
    if setting == "trl":
        trainer_cls, args = trl.GRPOTrainer, trl.GRPOConfig(**common)
    else:
        trainer_cls, args = GRPOTrainer, GRPOConfig(**common, reward_scoring=setting)
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    trainer = trainer_cls(
        model=default_model_path(),
        reward_funcs=[_slow_reward(cli.latency, i) for i in range(cli.functions)],
        args=args,
        train_dataset=addition_dataset("train", size=64),
    )
    trainer.add_callback(Clock())
    trainer.train()
    return statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--functions", type=int, default=2)
    parser.add_argument("--latency", type=float, default=0.3)
    cli = parser.parse_args()
    results: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(cli.repeats):
            for setting in SETTINGS:
                seconds = run(setting, cli, workdir)
                results[setting].append(seconds)
                print(f"repeat {repeat} {setting}: {seconds:.3f} s/step", file=sys.stderr)
    print(
        f"reward scoring: {cli.functions} synchronous functions of {cli.latency} s, 8 samples/step, HF generation, "
        f"{cli.steps} steps (2..N), medians of {cli.repeats}"
    )
    print("| trainer | reward_scoring | seconds/step | vs TRL |")
    print("|---|---|---|---|")
    trl_seconds = statistics.median(results["trl"])
    for setting in SETTINGS:
        seconds = statistics.median(results[setting])
        label = "trl.GRPOTrainer" if setting == "trl" else "trlx_scale.GRPOTrainer"
        shown = "-" if setting == "trl" else setting
        print(f"| {label} | {shown} | {seconds:.3f} | {trl_seconds / seconds:.2f}x |")


if __name__ == "__main__":
    main()
