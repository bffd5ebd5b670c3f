"""Padded vs padding-free packed log-prob passes on a long-tail workload, side by side in one run.

A randomly initialised Llama-style causal LM (4 layers, hidden 512, 8 heads, MLP 1408, fp32, sdpa) with TRL's fused
LM head, as GRPOTrainer runs it. One micro-batch = `--groups` prompts (lengths 32-96, left-padded) x
`--num-generations` completions whose lengths are log-normal with mean about a quarter of `--max-completion-len`
(sigma 0.8, clipped to [8, max]): the long tail RL rollouts have. A "step" is what the trainer runs per micro-batch
on the training side: the no-grad old-policy pass and the loss pass's forward + backward. Modes:

- `trl_padded`: TRL 1.16's own `GRPOTrainer._get_per_token_logps_and_entropies` (rows padded to the longest);
- `padded`: trlx_scale's `PaddedPass` (the same computation behind the pass interface);
- `packed`: `PackedPass` (padding-free rows, `padding_free="true"`, `max_tokens_per_microbatch` unset);
- `shared`: `SharedPrefixPass` (`shared_prefix="true"`: each group's prompt once, padded rows);
- `packed_shared`: `PrefixTreePass` (`shared_prefix="true"` with `padding_free="true"`: each group's prompt once
  inside packed rows, a tree attention mask).

Each repeat runs every mode back to back (the order rotates), so machine noise hits all of them; the table reports
medians and the median of the per-repeat ratios to `trl_padded`. Peak memory: each mode runs once more in a fresh
subprocess, which resets the kernel's peak-RSS mark once the model and batch are built (Linux). Before timing, every
mode's log-probs are checked against `trl_padded` (a benchmark of a wrong answer is worthless).

    python benchmarks/packing.py --repeats 5

Results and the command: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import torch
from shared_prefix import status_mib  # benchmarks/shared_prefix.py: this script's folder is on sys.path
from transformers import LlamaConfig, LlamaForCausalLM
from trl import GRPOTrainer as TRLGRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from trlx_scale.passes import PackedPass, PaddedPass, PassRequest, SharedPrefixPass
from trlx_scale.passes.packed_rows import PackedRows
from trlx_scale.passes.prefix_tree import PrefixTreePass, PrefixTreeRows
from trlx_scale.passes.shared_prefix import shared_positions_and_padding

MODES = ("trl_padded", "padded", "packed", "shared", "packed_shared")


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1408,
        vocab_size=args.vocab_size,
        max_position_embeddings=128 + args.max_completion_len,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).float()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    model.train()
    return model


def build_batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask, completion width): left-padded prompts, right-padded long-tail completions."""
    generator = torch.Generator().manual_seed(1)
    sigma = 0.8
    mean = args.max_completion_len / 4
    normal = torch.distributions.LogNormal(math.log(mean) - sigma**2 / 2, sigma)
    torch.manual_seed(2)
    lengths = normal.sample((args.groups * args.num_generations,)).clamp(8, args.max_completion_len).long().tolist()
    prompt_width, completion_width = 96, max(lengths)
    rows, masks = [], []
    for group in range(args.groups):
        prompt_len = 32 + (group * 37) % 65
        prompt = torch.randint(3, args.vocab_size, (prompt_len,), generator=generator)
        for g in range(args.num_generations):
            length = lengths[group * args.num_generations + g]
            completion = torch.randint(3, args.vocab_size, (length,), generator=generator)
            pad_left, pad_right = prompt_width - prompt_len, completion_width - length
            rows.append(
                torch.cat(
                    [
                        torch.zeros(pad_left, dtype=torch.long),
                        prompt,
                        completion,
                        torch.zeros(pad_right, dtype=torch.long),
                    ]
                )
            )
            masks.append(torch.cat([torch.zeros(pad_left), torch.ones(prompt_len + length), torch.zeros(pad_right)]))
    return torch.stack(rows), torch.stack(masks).long(), completion_width


def trl_pass():
    """TRL's own padded pass, bound to the little of a trainer it reads (the accelerator's autocast)."""
    holder = SimpleNamespace(accelerator=SimpleNamespace(autocast=contextlib.nullcontext, is_main_process=True))
    return TRLGRPOTrainer._get_per_token_logps_and_entropies.__get__(holder)


def make_pass(mode: str):
    padded = PaddedPass(trl_pass())
    packed = PackedPass(padded, agree_max=lambda n: n, autocast=contextlib.nullcontext)
    if mode == "padded":
        return padded
    if mode == "packed":
        return packed
    if mode == "shared":
        return SharedPrefixPass(padded, agree=lambda ok: ok, autocast=contextlib.nullcontext, inner_model=None)
    if mode == "packed_shared":
        return PrefixTreePass(packed, agree_max=lambda n: n, autocast=contextlib.nullcontext)
    raise ValueError(mode)


def logps(model, mode: str, batch, grad: bool) -> torch.Tensor:
    ids, mask, width = batch
    if mode == "trl_padded":
        return trl_pass()(model, ids, mask, width, compute_entropy=grad)[0]
    request = PassRequest(ids, mask, width, compute_entropy=grad)
    pass_ = make_pass(mode)
    if isinstance(pass_, SharedPrefixPass):
        pass_._inner_model = model
    return pass_.run(model, request).logps


def step(model, mode: str, batch) -> float:
    """The training side of a micro-batch: old-policy pass (no grad), then the loss pass's forward + backward."""
    ids, mask, width = batch
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.no_grad():
        logps(model, mode, batch, grad=False)
    completion_mask = mask[:, -width:]
    (logps(model, mode, batch, grad=True) * completion_mask).sum().backward()
    return time.perf_counter() - start


def peak_memory_worker(args: argparse.Namespace) -> None:
    model = build_model(args)
    batch = build_batch(args)
    step(model, args.worker, batch)  # allocator warm-up, as in the timed runs
    model.zero_grad(set_to_none=True)
    baseline = status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # Linux: reset the peak RSS (VmHWM) to the current RSS
    step(model, args.worker, batch)
    print(json.dumps({"peak_mib": status_mib("VmHWM") - baseline}))


def forwarded_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--max-completion-len", str(args.max_completion_len), "--num-generations", str(args.num_generations)]
    return flags + ["--groups", str(args.groups), "--vocab-size", str(args.vocab_size), "--threads", str(args.threads)]


def peak_memory(args: argparse.Namespace, mode: str) -> float:
    command = [sys.executable, __file__, "--worker", mode, *forwarded_flags(args)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_mib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-completion-len", type=int, default=512)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        peak_memory_worker(args)
        return

    model = build_model(args)
    batch = build_batch(args)
    ids, mask, width = batch
    completion = mask[:, -width:].bool()
    with torch.no_grad():
        reference = logps(model, "trl_padded", batch, grad=False)
        for mode in MODES[1:]:
            gap = (logps(model, mode, batch, grad=False) - reference)[completion].abs().max().item()
            assert gap < 1e-4, f"{mode} differs from TRL's pass by {gap}"
    rows = PackedRows.build(ids, mask, width)
    real = int(mask.sum())
    tree = PrefixTreeRows.build(ids, mask, width)
    shared_positions, shared_padding = shared_positions_and_padding(ids, mask, width)
    positions = {  # token positions each mode's forwards run, and how many of them no sample owns
        "trl_padded": (ids.numel(), ids.numel() - real),
        "padded": (ids.numel(), ids.numel() - real),
        "packed": (rows.processed_tokens, rows.processed_tokens - real),
        "shared": (shared_positions, shared_padding),
        "packed_shared": (tree.processed_tokens, tree.processed_tokens - tree.owned_tokens),
    }
    for mode in MODES:  # warm-up
        step(model, mode, batch)
    times = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        order = MODES[repeat % len(MODES) :] + MODES[: repeat % len(MODES)]
        for mode in order:
            times[mode].append(step(model, mode, batch))
    lengths = mask[:, -width:].sum(-1)
    print(
        f"rows {ids.size(0)}, padded width {ids.size(1)}, completion lengths mean {lengths.float().mean():.0f} "
        f"max {int(lengths.max())}, real tokens {real}"
    )
    print(
        "| mode | step s (median) | vs trl_padded (median of ratios) | real tokens/s | positions | pad_frac | peak MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    results = {}
    for mode in MODES:
        median = statistics.median(times[mode])
        ratio = statistics.median(t_trl / t for t_trl, t in zip(times["trl_padded"], times[mode], strict=True))
        peak = peak_memory(args, mode)
        processed, padding = positions[mode]
        frac = padding / processed
        results[mode] = {
            "step_s": median,
            "speedup": ratio,
            "tokens_per_s": real / median,
            "peak_mib": peak,
            "positions": processed,
            "pad_frac": frac,
        }
        print(
            f"| `{mode}` | {median:.3f} | {ratio:.2f}x | {real / median:.0f} | {processed:.0f} | {frac:.3f} | "
            f"{peak:.0f} |"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
