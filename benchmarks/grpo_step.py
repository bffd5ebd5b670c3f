"""One GRPO training step, TRL 1.16 against trlx_scale, side by side in one run on the same configuration.

Configuration (the issue's): a ~30M-parameter Llama built locally (4 layers, hidden 512, vocabulary 32000, fp32), LoRA
r16 on every linear layer, prompts of 256 tokens, 64-token completions, G=8, 4 prompts per step, one optimizer step
per generation. Variants, each in its own process (its own engine, its own peak RSS):

- ``trl_hf``: ``trl.GRPOTrainer``, ``use_vllm=False`` (HF ``generate``);
- ``trl_vllm``: ``trl.GRPOTrainer``, ``use_vllm=True, vllm_mode="colocate"`` (merge-and-push sync);
- ``ours``: ``trlx_scale.GRPOTrainer`` with what a user turns on (colocated engine, ``shared_prefix="auto"``) and
  every other option at its default (``vllm_sync_mode``, ``vllm_dtype``);
- ``ours_lora`` / ``ours_full``: the same with ``vllm_sync_mode`` forced to "lora" / "full";
- ``ours_fp32`` / ``ours_bf16``: ``ours`` with ``vllm_dtype`` forced to "trainer" (fp32 here) / "auto" (bf16 on CPU);
- ``ours_old_pass``: ``ours`` with ``old_logprobs_from_loss_pass=False`` (TRL's separate old-policy pass);
- ``ours_padded``: ``ours`` with ``padding_free=False`` (padded rows, as TRL);
- ``ours_noshare`` / ``ours_noshare_padded``: the default config (``shared_prefix="false"``), packed rows
  (``padding_free=None``, the default) / padded rows.

Seconds per step come from one clock for every variant (a callback at each step's end); the median over steps after
the first (warm-up) is a run's figure. Phases: trlx_scale's own ``time/*`` metrics; for TRL the same profiler mixed
into a subclass that times TRL's methods (``TimedTRLGRPOTrainer``). Each repeat runs every variant once, in an order
that rotates; the speed-up is the median over repeats of (TRL's fastest runnable path / variant).

    python benchmarks/grpo_step.py --repeats 3 --steps 6 --json-out /tmp/grpo_step.json
    python benchmarks/grpo_step.py --model small --variants trl_vllm,ours  # where TRL's colocated path runs

Results and the commands: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in the trainer's process (colocated)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VARIANTS = (
    "trl_hf",
    "trl_vllm",
    "ours",
    "ours_lora",
    "ours_full",
    "ours_fp32",
    "ours_bf16",
    "ours_old_pass",
    "ours_padded",
    "ours_noshare",
    "ours_noshare_padded",
)
TRL_VARIANTS = ("trl_hf", "trl_vllm")


def _model_dir(name: str) -> tuple[str, int]:
    from bench_assets import build_model_dir, llama_30m, llama_small

    if name == "embedded":  # the package's own 0.8M-parameter model and its character-level tokenizer
        from trlx_scale.tasks.default_model import default_model_path

        return default_model_path(), 10  # prompts of digits "t3 t7 ..." stay inside its character set

    config = {"30m": llama_30m, "small": llama_small}[name]()
    return build_model_dir(f"grpo_step_{name}", config), config.vocab_size


def _config(cls, args, output_dir: str, use_vllm: bool, **extra):
    return cls(
        output_dir=output_dir,
        per_device_train_batch_size=args.prompts * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.completion_len,
        max_steps=args.steps,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_max_model_length=args.prompt_len + args.completion_len + 8,
        **extra,
    )


def _timed_trl_trainer_cls():
    """TRL's trainer with trlx_scale's profiler mixed in and TRL's methods timed (nothing else changes)."""
    import torch
    import trl

    from trlx_scale.profiling.trainer_profiling import StepProfiler

    class TimedTRLGRPOTrainer(trl.GRPOTrainer):
        def __init__(self, *args, **kwargs):
            self.profiler = StepProfiler(self, kwargs.get("args"))
            self.phase_timer = self.profiler.phase_timer
            super().__init__(*args, **kwargs)
            self.profiler.start()

        def training_step(self, model, inputs, num_items_in_batch=None):
            with self.profiler.profiled_step():
                return super().training_step(model, inputs, num_items_in_batch)

        def log(self, logs, start_time=None):
            super().log({**logs, **self.profiler.log_metrics(logs)}, start_time)

        def _prepare_inputs(self, generation_batch):
            with self.phase_timer.phase("rollout"):
                return super()._prepare_inputs(generation_batch)

        def _calculate_rewards(self, *args, **kwargs):
            with self.phase_timer.phase("reward"):
                return super()._calculate_rewards(*args, **kwargs)

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            with self.phase_timer.phase("generation"):
                result = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            self.profiler.count_generation(prompt_ids, result[0])
            return result

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, *args, **kwargs):
            training = torch.is_grad_enabled()
            with self.phase_timer.phase("old_logprobs") if not training else contextlib.nullcontext():
                result = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, *args, **kwargs)
            self.profiler.count_logprob_pass(attention_mask, training=training)
            return result

    return TimedTRLGRPOTrainer


def _time_engine_sync(trainer) -> None:
    """TRL syncs through ``self.vllm_generation.sync_weights()`` with no hook: time that one object's method."""
    engine = getattr(trainer, "vllm_generation", None)
    if engine is None:
        return
    sync = engine.sync_weights

    def timed_sync(*args, **kwargs):
        with trainer.phase_timer.phase("weight_sync"):
            return sync(*args, **kwargs)

    engine.sync_weights = timed_sync


def run_variant(args) -> dict:
    """One variant in this process: build, train ``args.steps`` steps, report per-step seconds and phases."""
    from bench_assets import word_prompts
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback

    model_dir, vocab = _model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = word_prompts(args.prompts * (args.steps + 2), args.prompt_len, vocab)
    dataset = Dataset.from_dict({"prompt": prompts})
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")

    def reward_len(completions, **kwargs):  # cheap and deterministic: the reward is not what is measured
        return [float(len(c) % 7) for c in completions]

    variant = args.worker
    output_dir = os.path.join(args.scratch, variant)
    if variant in TRL_VARIANTS:
        import trl

        config = _config(trl.GRPOConfig, args, output_dir, use_vllm=variant == "trl_vllm")
        trainer_cls = _timed_trl_trainer_cls()
    else:
        from trlx_scale import GRPOConfig, GRPOTrainer

        extra = {"shared_prefix": "auto"}
        if variant == "ours_lora":
            extra["vllm_sync_mode"] = "lora"
        elif variant == "ours_full":
            extra["vllm_sync_mode"] = "full"
        elif variant == "ours_fp32":
            extra["vllm_dtype"] = "trainer"
        elif variant == "ours_bf16":
            extra["vllm_dtype"] = "auto"
        elif variant == "ours_old_pass":
            extra["old_logprobs_from_loss_pass"] = False
        elif variant == "ours_padded":
            extra["padding_free"] = "false"
        elif variant == "ours_noshare":
            extra["shared_prefix"] = "false"
        elif variant == "ours_noshare_padded":
            extra.update(shared_prefix="false", padding_free=False)
        config = _config(GRPOConfig, args, output_dir, use_vllm=True, **extra)
        trainer_cls = GRPOTrainer

    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            step_ends.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            step_ends.append(time.perf_counter())

    trainer = trainer_cls(
        model=model_dir,
        reward_funcs=reward_len,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[StepClock()],
    )
    _time_engine_sync(trainer)
    trainer.train()
    seconds = [b - a for a, b in zip(step_ends, step_ends[1:], strict=False)]
    history = [e for e in trainer.state.log_history if "time/step" in e]
    phases = {}
    for entry in history[1:]:
        for key, value in entry.items():
            if key.startswith("time/") and key not in ("time/step", "time/profiler_fraction"):
                phases.setdefault(key.removeprefix("time/"), []).append(value)
    gaps = [
        e.get("sampling/sampling_logp_difference/mean")
        for e in trainer.state.log_history
        if e.get("sampling/sampling_logp_difference/mean") is not None
    ]
    sync_mode = getattr(getattr(trainer, "vllm_generation", None), "sync_mode", None)
    return {
        "variant": variant,
        "step_seconds": seconds,
        "median_step_seconds": statistics.median(seconds[1:]),
        "phases_median": {name: statistics.median(values) for name, values in phases.items()},
        "profiler_fraction": statistics.median([e["time/profiler_fraction"] for e in history[1:]] or [0.0]),
        "logprob_gap_mean": statistics.median(gaps) if gaps else None,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "sync_mode": sync_mode,
        "engine_dtype": str(getattr(getattr(trainer, "vllm_generation", None), "dtype", None)),
    }


def _run_child(args, variant: str) -> dict:
    out = os.path.join(args.scratch, f"{variant}.json")
    command = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--result", out]
    for flag in ("model", "steps", "prompts", "num_generations", "prompt_len", "completion_len", "scratch"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if os.path.exists(out):
        os.remove(out)
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if os.path.exists(out):
        with open(out) as handle:
            payload = json.load(handle)
    else:
        tail = (result.stderr or result.stdout)[-3000:]
        payload = {"variant": variant, "error": tail.strip().splitlines()[-1] if tail.strip() else "no output"}
    payload["wall_seconds"] = time.perf_counter() - started
    return payload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("30m", "small", "embedded"), default="30m")
    parser.add_argument("--variants", default="trl_hf,trl_vllm,ours,ours_lora,ours_full")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4, help="distinct prompts per step")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=64)
    parser.add_argument("--scratch", default="/tmp/trlx_scale_grpo_step")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.scratch, exist_ok=True)

    if args.worker is not None:
        from bench_assets import dump

        try:
            dump(args.result, run_variant(args))
        except Exception:
            traceback.print_exc()
            sys.exit(1)
        return

    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {VARIANTS}")
    _model_dir(args.model)  # build once, before the timed runs
    runs: list[dict] = []
    for repeat in range(args.repeats):
        order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
        for variant in order:
            result = _run_child(args, variant)
            result["repeat"] = repeat
            runs.append(result)
            status = result.get("error") or f"{result['median_step_seconds']:.2f} s/step"
            print(f"repeat {repeat} {variant:10s} {status}", flush=True)
    summary = summarize(runs, variants)
    print_table(summary, args)
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump({"args": vars(args), "runs": runs, "summary": summary}, handle, indent=2)


def summarize(runs: list[dict], variants: list[str]) -> dict:
    by_variant: dict[str, dict] = {}
    for variant in variants:
        ok = [r for r in runs if r["variant"] == variant and "error" not in r]
        failed = [r for r in runs if r["variant"] == variant and "error" in r]
        if not ok:
            by_variant[variant] = {"error": failed[0]["error"] if failed else "not run"}
            continue
        phase_names = sorted({p for r in ok for p in r["phases_median"]})
        by_variant[variant] = {
            "median_step_seconds": statistics.median(r["median_step_seconds"] for r in ok),
            "range": [min(r["median_step_seconds"] for r in ok), max(r["median_step_seconds"] for r in ok)],
            "phases": {p: statistics.median(r["phases_median"].get(p, 0.0) for r in ok) for p in phase_names},
            "peak_rss_gb": statistics.median(r["peak_rss_gb"] for r in ok),
            "logprob_gap_mean": ok[0]["logprob_gap_mean"],
            "profiler_fraction": statistics.median(r["profiler_fraction"] for r in ok),
            "sync_mode": ok[0]["sync_mode"],
            "engine_dtype": ok[0]["engine_dtype"],
        }
    # Speed-up per repeat against TRL's fastest runnable path in that repeat.
    repeats = sorted({r["repeat"] for r in runs})
    for variant in variants:
        ratios = []
        for repeat in repeats:
            same = {r["variant"]: r for r in runs if r["repeat"] == repeat and "error" not in r}
            trl = [same[v]["median_step_seconds"] for v in TRL_VARIANTS if v in same]
            if trl and variant in same:
                ratios.append(min(trl) / same[variant]["median_step_seconds"])
        if ratios and "error" not in by_variant[variant]:
            by_variant[variant]["speedup_vs_trl_fastest"] = {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
    return by_variant


def print_table(summary: dict, args) -> None:
    print(
        f"\nGRPO step, model {args.model}, P={args.prompt_len} C={args.completion_len} G={args.num_generations} "
        f"x {args.prompts} prompts, {args.steps} steps x {args.repeats} repeats"
    )
    print("| variant | s/step (median) | speed-up vs TRL's fastest | peak RSS GB | sync | engine dtype | gap |")
    print("|---|---|---|---|---|---|---|")
    for variant, row in summary.items():
        if "error" in row:
            print(f"| {variant} | fails: {row['error'][:120]} | | | | | |")
            continue
        speed = row.get("speedup_vs_trl_fastest")
        speed_text = f"{speed['median']:.2f}x ({speed['min']:.2f}-{speed['max']:.2f})" if speed else "n/a"
        gap = row["logprob_gap_mean"]
        print(
            f"| {variant} | {row['median_step_seconds']:.2f} ({row['range'][0]:.2f}-{row['range'][1]:.2f}) | "
            f"{speed_text} | {row['peak_rss_gb']:.2f} | {row['sync_mode']} | {row['engine_dtype']} | "
            f"{'n/a' if gap is None else f'{gap:.1e}'} |"
        )
    print("\nPhases (median s/step):")
    for variant, row in summary.items():
        if "phases" in row:
            print(f"  {variant}: " + ", ".join(f"{k} {v:.3f}" for k, v in row["phases"].items() if v > 0.0005))


if __name__ == "__main__":
    main()
