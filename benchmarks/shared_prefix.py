"""Shared-prefix vs duplicated (TRL's) log-prob pass and forward+backward, side by side in one run.

A randomly initialised Llama-style causal LM (4 layers, hidden 512, 8 heads, MLP 1408, vocabulary 32000, fp32) with
TRL's fused LM head, as GRPOTrainer runs it. One batch = `--groups` prompts of `--prompt-len` tokens, each with
`--num-generations` completions of `--completion-len` tokens. Each repeat times both modes back to back (the order
alternates), so machine noise hits both; the table reports medians and the median of the per-repeat ratios. Peak
memory: each mode and pass runs once more in a fresh subprocess, which resets the kernel's peak-RSS mark once the
model and batch are built and reports the peak above that baseline (Linux).

    python benchmarks/shared_prefix.py --repeats 5

Results and the command: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from trl.trainer.utils import add_fused_lm_head

from trlx_scale.passes.shared_prefix import shared_prefix_logps

MODES = ("duplicated", "shared")


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1408,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.prompt_len + args.completion_len,
    )
    model = LlamaForCausalLM(config).float()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    return model


def build_batch(args: argparse.Namespace, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(args.groups):
        prompt = torch.randint(3, vocab_size, (args.prompt_len,), generator=generator)
        for _ in range(args.num_generations):
            rows.append(torch.cat([prompt, torch.randint(3, vocab_size, (args.completion_len,), generator=generator)]))
    input_ids = torch.stack(rows)
    return input_ids, torch.ones_like(input_ids)


def logps(model, mode: str, input_ids, attention_mask, completion_len: int) -> torch.Tensor:
    if mode == "shared":
        return shared_prefix_logps(model, input_ids, attention_mask, completion_len)[0]
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-completion_len] = -100
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True).log_probs[
        :, -completion_len:
    ]


def time_logprob_pass(model, mode, batch, completion_len) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        logps(model, mode, *batch, completion_len)
    return time.perf_counter() - start


def time_forward_backward(model, mode, batch, completion_len) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    logps(model, mode, *batch, completion_len).sum().backward()
    return time.perf_counter() - start


def status_mib(field: str) -> float:
    """A memory line of /proc/self/status (VmRSS: now, VmHWM: peak since the last reset), in MiB."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_memory_worker(args: argparse.Namespace) -> None:
    """One mode, one pass kind, in this fresh process: peak RSS growth above the loaded model and batch."""
    model = build_model(args)
    batch = build_batch(args, model.config.vocab_size)
    baseline = status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # Linux: reset the peak RSS (VmHWM) to the current RSS
    (time_logprob_pass if args.worker_pass == "logprob" else time_forward_backward)(
        model, args.worker, batch, args.completion_len
    )
    print(json.dumps({"peak_mib": status_mib("VmHWM") - baseline}))


def peak_memory(args: argparse.Namespace, mode: str, pass_kind: str) -> float:
    command = [sys.executable, __file__, "--worker", mode, "--worker-pass", pass_kind, *forwarded_flags(args)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_mib"]


def forwarded_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--prompt-len", str(args.prompt_len), "--completion-len", str(args.completion_len)]
    flags += ["--num-generations", str(args.num_generations), "--groups", str(args.groups)]
    flags += ["--vocab-size", str(args.vocab_size), "--threads", str(args.threads)]
    return flags + (["--gradient-checkpointing"] if args.gradient_checkpointing else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--completion-len", type=int, default=128)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--worker-pass", choices=("logprob", "fwd_bwd"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        peak_memory_worker(args)
        return

    model = build_model(args)
    batch = build_batch(args, model.config.vocab_size)
    with torch.no_grad():  # the two modes compute the same log-probs (a benchmark of a wrong answer is worthless)
        gap = (
            logps(model, "shared", *batch, args.completion_len)
            - logps(model, "duplicated", *batch, args.completion_len)
        ).abs()
    for mode in MODES:  # warm-up
        time_forward_backward(model, mode, batch, args.completion_len)
    times = {(mode, kind): [] for mode in MODES for kind in ("logprob", "fwd_bwd")}
    for repeat in range(args.repeats):
        order = MODES if repeat % 2 == 0 else MODES[::-1]
        for mode in order:
            times[(mode, "logprob")].append(time_logprob_pass(model, mode, batch, args.completion_len))
            times[(mode, "fwd_bwd")].append(time_forward_backward(model, mode, batch, args.completion_len))

    ideal = args.num_generations * (args.prompt_len + args.completion_len)
    ideal /= args.prompt_len + args.num_generations * args.completion_len
    print(
        f"model: 4 layers, hidden 512, vocab {args.vocab_size}, fp32; batch: {args.groups} prompt(s) x "
        f"G={args.num_generations}, prompt {args.prompt_len}, completion {args.completion_len}; "
        f"threads {args.threads}; gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}; "
        f"{args.repeats} repeats; max |log-prob difference| {gap.max().item():.2e}; ideal token ratio {ideal:.2f}x"
    )
    print(
        "| pass | duplicated (s, median) | shared (s, median) | speed-up (median of ratios) | peak mem dup / shared (MiB) |"
    )
    print("|---|---|---|---|---|")
    for kind, label in (("logprob", "log-prob pass (no grad)"), ("fwd_bwd", "forward + backward")):
        dup, shared = times[("duplicated", kind)], times[("shared", kind)]
        ratios = [d / s for d, s in zip(dup, shared, strict=True)]
        mem = [peak_memory(args, mode, kind) for mode in MODES]
        print(
            f"| {label} | {statistics.median(dup):.3f} | {statistics.median(shared):.3f} | "
            f"{statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f}) | "
            f"{mem[0]:.0f} / {mem[1]:.0f} |"
        )


if __name__ == "__main__":
    main()
