"""Padded vs padding-free packed log-prob passes on a long-tail workload, side by side in one run.

A randomly initialised Llama-style causal LM (4 layers, hidden 512, 8 heads, MLP 1408, fp32, sdpa) with TRL's fused
LM head, as GRPOTrainer runs it. One micro-batch = `--groups` prompts (lengths 32-96, left-padded) x
`--num-generations` completions whose lengths are log-normal with mean about a quarter of `--max-completion-len`
(sigma 0.8, clipped to [8, max]): the long tail RL rollouts have. A "step" is what the trainer runs per micro-batch
on the training side: the no-grad old-policy pass and the loss pass's forward + backward. Modes:

- `trl_padded`: TRL 1.16's own `GRPOTrainer._get_per_token_logps_and_entropies` (rows padded to the longest);
- `padded`: trlx_scale's `PaddedPass` (the same computation behind the pass interface);
- `packed`: `PackedPass` (padding-free rows, `padding_free="true"`, `max_tokens_per_microbatch` unset), rows of the
  width the cost model picks (`choose_row_width`: a little wider than the longest sample where that saves a row);
- `packed_longest_rows`: the same with every row as wide as the longest sample (the width choice's baseline);
- `shared`: `SharedPrefixPass` (`shared_prefix="true"`: each group's prompt once, padded rows);
- `packed_shared`: `PrefixTreePass` (`shared_prefix="true"` with `padding_free="true"`: each group's prompt once
  inside packed rows, a tree attention mask);
- with `--budget N` (1 process) instead: `packed` against `packed_budget` (`max_tokens_per_microbatch=N`, every
  forward's graph kept until the backward, `recompute_forwards="false"`) and `packed_budget_recomputed` (the same
  with `recompute_forwards` on: each forward recomputed in the backward), with `--gradient-checkpointing` or not;
- `packed_balanced` (`--zero3` only): `packed` after the ranks' samples were dealt by cost (`balance_ranks`,
  `rollout/rank_balance.py`: each rank keeps 16 samples); the exchange itself, once per rollout in the trainer, is
  timed apart.

Each repeat runs every mode back to back (the order rotates), so machine noise hits all of them; the table reports
medians and the median of the per-repeat ratios to `trl_padded`. Peak memory: each mode runs once more in a fresh
subprocess, which resets the kernel's peak-RSS mark once the model and batch are built (Linux). Before timing, every
mode's log-probs are checked against `trl_padded` (a benchmark of a wrong answer is worthless).

    python benchmarks/packing.py --repeats 5
    python benchmarks/packing.py --repeats 5 --zero3     # 2 processes, DeepSpeed ZeRO-3 (cpu_zero3.yaml)
    python benchmarks/packing.py --repeats 5 --budget 512 [--gradient-checkpointing]
    python benchmarks/packing.py --device cuda --hidden 2048 --layers 8 --heads 16 --intermediate 5632 ...

On a GPU (`--device cuda`, 1 process; benchmarks/device_check.sh runs it at a 0.55B shape) the model and batch live
on the device, each step waits for its kernels, and peak memory is the CUDA caching allocator's peak of live tensors
over a step (`max_memory_allocated`), each mode in a fresh process as on CPU.

`--zero3` runs the same step on 2 processes through `accelerate launch` with parameters, gradients and optimizer
states sharded by DeepSpeed ZeRO-3 (gloo): each rank has its own micro-batch (its own completion lengths), every
forward gathers the weights, the loss pass's backward runs through DeepSpeed's engine (an SGD step at lr 0, so the
weights stay put), and a step's time is the slowest rank's. Peak memory: the largest rank's, one fresh launch per
mode. Results and the commands: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
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
from trlx_scale.passes.micro_batch_plan import attention_cost_coefficient, sample_cost
from trlx_scale.passes.packed_rows import PackedRows
from trlx_scale.passes.prefix_tree import PrefixTreePass, PrefixTreeRows
from trlx_scale.passes.shared_prefix import all_ranks_can_share, shared_positions_and_padding
from trlx_scale.rollout.rank_balance import balanced_rank_assignment, exchange_rows

MODES = ("trl_padded", "padded", "packed", "packed_longest_rows", "shared", "packed_shared")
ZERO3_MODES = (*MODES, "packed_balanced")
# --budget N: packed rows under max_tokens_per_microbatch=N, the forwards' graphs kept or recomputed (1 process).
BUDGET_MODES = ("packed", "packed_budget", "packed_budget_recomputed")
ZERO3_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "accelerate")


# The model's shape (--hidden, --layers, --heads, --intermediate; the defaults are the CPU tables' model).
SHAPE = {"hidden": 512, "layers": 4, "heads": 8, "intermediate": 1408}


def coefficient() -> float:
    """The packed rows' attention cost coefficient of the model's shape, as the trainer derives it."""
    return attention_cost_coefficient(SHAPE["hidden"], SHAPE["intermediate"])


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=SHAPE["hidden"],
        num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["heads"],
        intermediate_size=SHAPE["intermediate"],
        vocab_size=args.vocab_size,
        max_position_embeddings=128 + args.max_completion_len,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).float().to(args.device)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    if getattr(args, "gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # TRL's default
    model.train()
    return model


def build_batch(args: argparse.Namespace, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask, completion width): left-padded prompts, right-padded long-tail completions;
    ``rank``: another rank's micro-batch (other prompts and lengths; rank 0's is the 1-process batch)."""
    generator = torch.Generator().manual_seed(1 + 100 * rank)
    sigma = 0.8
    mean = args.max_completion_len / 4
    normal = torch.distributions.LogNormal(math.log(mean) - sigma**2 / 2, sigma)
    torch.manual_seed(2 + 100 * rank)
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
    device = getattr(args, "device", "cpu")
    return torch.stack(rows).to(device), torch.stack(masks).long().to(device), completion_width


def trl_pass():
    """TRL's own padded pass, bound to the little of a trainer it reads (the accelerator's autocast)."""
    holder = SimpleNamespace(accelerator=SimpleNamespace(autocast=contextlib.nullcontext, is_main_process=True))
    return TRLGRPOTrainer._get_per_token_logps_and_entropies.__get__(holder)


def agree_max(value: int) -> int:
    """The ranks' largest value (forward counts under ZeRO-3, as the trainer's ``_agree_max``); the value itself on
    one process."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def make_pass(mode: str, budget: int | None = None):
    padded = PaddedPass(trl_pass())
    common = dict(agree_max=agree_max, autocast=contextlib.nullcontext)
    packed = PackedPass(padded, **common, coefficient=coefficient())
    if mode == "padded":
        return padded
    if mode in ("packed_budget", "packed_budget_recomputed"):
        return PackedPass(padded, **common, max_tokens=budget, recompute=mode == "packed_budget_recomputed")
    if mode in ("packed", "packed_balanced"):
        return packed
    if mode == "packed_longest_rows":
        return PackedPass(padded, **common)
    if mode == "shared":
        agree = functools.partial(all_ranks_can_share, sharded=True)
        return SharedPrefixPass(padded, agree=agree, autocast=contextlib.nullcontext, inner_model=None)
    if mode == "packed_shared":
        return PrefixTreePass(packed, **common, coefficient=coefficient())
    raise ValueError(mode)


def logps(model, mode: str, batch, grad: bool, budget: int | None = None) -> torch.Tensor:
    ids, mask, width = batch
    if mode == "trl_padded":
        return trl_pass()(model, ids, mask, width, compute_entropy=grad)[0]
    request = PassRequest(ids, mask, width, compute_entropy=grad)
    pass_ = make_pass(mode, budget)
    if isinstance(pass_, SharedPrefixPass):
        pass_._inner_model = getattr(model, "module", model)  # a DeepSpeed engine: the model inside
    return pass_.run(model, request).logps


def step(model, mode: str, batch, accelerator=None, budget: int | None = None) -> float:
    """The training side of a micro-batch: old-policy pass (no grad), then the loss pass's forward + backward
    (through DeepSpeed's engine when an ``accelerator`` is given: its backward and its lr-0 step)."""
    ids, mask, width = batch
    if accelerator is None:
        model.zero_grad(set_to_none=True)  # (DeepSpeed's engine zeroes its gradients in its step)
    synchronize(ids)
    start = time.perf_counter()
    with torch.no_grad():
        logps(model, mode, batch, grad=False, budget=budget)
    completion_mask = mask[:, -width:]
    loss = (logps(model, mode, batch, grad=True, budget=budget) * completion_mask).sum()
    if accelerator is None:
        loss.backward()
    else:
        accelerator.backward(loss)
    synchronize(ids)
    return time.perf_counter() - start


def tolerance(ids: torch.Tensor) -> float:
    """The largest log-prob gap to TRL's pass a correct layout shows in fp32: rounding (CPU: ~1e-6; CUDA's kernels
    differ by shape more). Samples that attend to each other differ by ~0.5."""
    return 1e-3 if ids.is_cuda else 1e-4


def synchronize(tensor: torch.Tensor) -> None:
    """Wait for the device's queued kernels (CUDA runs them asynchronously; a step's time must include them)."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def peak_memory_worker(args: argparse.Namespace) -> None:
    model = build_model(args)
    batch = build_batch(args)
    step(model, args.worker, batch, budget=args.budget)  # allocator warm-up, as in the timed runs
    model.zero_grad(set_to_none=True)
    if args.device.startswith("cuda"):  # the caching allocator's own count: the peak of live tensors
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        step(model, args.worker, batch, budget=args.budget)
        print(json.dumps({"peak_mib": (torch.cuda.max_memory_allocated() - baseline) / 2**20}))
        return
    baseline = status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # Linux: reset the peak RSS (VmHWM) to the current RSS
    step(model, args.worker, batch, budget=args.budget)
    print(json.dumps({"peak_mib": status_mib("VmHWM") - baseline}))


def forwarded_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--max-completion-len", str(args.max_completion_len), "--num-generations", str(args.num_generations)]
    flags += ["--groups", str(args.groups), "--vocab-size", str(args.vocab_size), "--threads", str(args.threads)]
    flags += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
    flags += ["--device", args.device] + [f"--{name}={value}" for name, value in SHAPE.items()]
    return flags + (["--budget", str(args.budget)] if args.budget else [])


def zero3_worker(args: argparse.Namespace) -> None:
    """One `accelerate launch` rank: time every mode (the slowest rank's time per step), or with ``--peak`` the one
    mode's peak RSS over a step (the largest rank's); rank 0 prints a JSON line."""
    import torch.distributed as dist
    from accelerate import Accelerator, PartialState

    PartialState(backend="gloo")  # CPU processes: DeepSpeed over gloo, as the trainers run it (examples/grpo.py)
    accelerator = Accelerator()
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
    model = build_model(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = build_batch(args, rank=accelerator.process_index)
    modes = args.zero3_worker.split(",")
    start = time.perf_counter()
    balanced = balanced_batch(batch, accelerator)
    exchange_s = slowest_rank(time.perf_counter() - start)
    batches = {mode: balanced if mode == "packed_balanced" else batch for mode in ["padded", *modes]}

    # Warm-up (the allocator, DeepSpeed's first gathers). A padded step first: when the shared pass's two forwards
    # (prompt, then completions over its cache) are this bare engine's very first forward and backward, DeepSpeed
    # fails in that backward ("size of tensor a (0)": a released partition). The trainer's runs do not meet it
    # (tests/test_shared_prefix_sharded.py, and a full-weight run without checkpointing, docs/benchmarks.md).
    for mode in ["padded", *modes]:
        step(model, mode, batches[mode], accelerator)
    if args.peak:
        dist.barrier()
        baseline = status_mib("VmRSS")
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        step(model, modes[0], batches[modes[0]], accelerator)
        peak = torch.tensor([status_mib("VmHWM") - baseline], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        result = {"peak_mib": float(peak.item())}
    else:
        times = {mode: [] for mode in modes}
        for repeat in range(args.repeats):
            for mode in modes[repeat % len(modes) :] + modes[: repeat % len(modes)]:
                dist.barrier()
                times[mode].append(slowest_rank(step(model, mode, batches[mode], accelerator)))
        ids, mask, width = batch
        counts = [positions_of(batches[mode])[mode] for mode in modes]
        counts = torch.tensor(counts, dtype=torch.float64).reshape(-1)
        dist.all_reduce(counts)  # positions and padding summed over the ranks
        real = torch.tensor([float(mask.sum())], dtype=torch.float64)
        dist.all_reduce(real)
        costs = [rank_cost(b) for b in (batch, balanced)]
        result = {
            "times": times,
            "positions": counts.view(len(modes), 2).tolist(),
            "real": float(real.item()),
            "exchange_s": exchange_s,
            "rank_imbalance": {"trl_placement": imbalance(costs[0]), "balanced": imbalance(costs[1])},
        }
    if accelerator.is_main_process:
        print(json.dumps(result), flush=True)
    # Free what holds collectives, wait for every rank, then leave the group: a rank tearing gloo down at exit while
    # the other still has work in flight aborts ("terminate called without an active exception").
    del model, optimizer, accelerator
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def slowest_rank(seconds: float) -> float:
    import torch.distributed as dist

    tensor = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def rank_cost(batch) -> float:
    """This rank's packed-row cost (``sample_cost`` summed over its samples)."""
    return sum(sample_cost(int(length), coefficient()) for length in batch[1].sum(dim=1))


def imbalance(cost: float) -> float:
    """Max over mean of the ranks' ``cost``."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, cost)
    return max(gathered) / (sum(gathered) / len(gathered))


def balanced_batch(batch, accelerator):
    """The ranks' samples dealt by cost, as ``balance_ranks`` deals a rollout (the same rows dict and exchange)."""
    ids, mask, width = batch
    rows = {
        "prompt_ids": ids[:, :-width],
        "prompt_mask": mask[:, :-width],
        "completion_ids": ids[:, -width:],
        "completion_mask": mask[:, -width:],
    }
    lengths = accelerator.gather(mask.sum(dim=1)).tolist()
    assignment = balanced_rank_assignment(lengths, accelerator.num_processes, coefficient())
    moved = exchange_rows(rows, assignment[accelerator.process_index], ids.size(0), accelerator)
    ids = torch.cat([moved["prompt_ids"], moved["completion_ids"]], dim=1)
    mask = torch.cat([moved["prompt_mask"], moved["completion_mask"]], dim=1)
    return ids, mask, moved["completion_ids"].size(1)


def launch_zero3(args: argparse.Namespace, modes: list[str], peak: bool = False) -> dict:
    config = os.path.join(ZERO3_CONFIG, "cpu_zero3.yaml")
    command = ["accelerate", "launch", "--config_file", config, "--main_process_port", str(args.port), __file__]
    command += ["--zero3-worker", ",".join(modes), "--repeats", str(args.repeats), *forwarded_flags(args)]
    command += ["--threads", str(max(1, args.threads // 2))] + (["--peak"] if peak else [])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"the ZeRO-3 launch failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def positions_of(batch) -> dict[str, tuple[float, float]]:
    """Token positions each mode's forwards run, and how many of them no sample owns."""
    ids, mask, width = batch
    real = int(mask.sum())
    rows = PackedRows.build(ids, mask, width, coefficient=coefficient())
    longest_rows = PackedRows.build(ids, mask, width)
    tree = PrefixTreeRows.build(ids, mask, width, coefficient=coefficient())
    shared_positions, shared_padding = shared_positions_and_padding(ids, mask, width)
    return {
        "trl_padded": (ids.numel(), ids.numel() - real),
        "padded": (ids.numel(), ids.numel() - real),
        "packed": (rows.processed_tokens, rows.processed_tokens - real),
        "packed_balanced": (rows.processed_tokens, rows.processed_tokens - real),
        "packed_longest_rows": (longest_rows.processed_tokens, longest_rows.processed_tokens - real),
        "shared": (shared_positions, shared_padding),
        "packed_shared": (tree.processed_tokens, tree.processed_tokens - tree.owned_tokens),
    }


def budget_main(args: argparse.Namespace) -> None:
    """``--budget``: what ``recompute_forwards`` buys and costs under the token budget (see the module docstring)."""
    model, batch = build_model(args), build_batch(args)
    ids, mask, width = batch
    completion = mask[:, -width:].bool()
    with torch.no_grad():
        reference = logps(model, "trl_padded", batch, grad=False)
        for mode in BUDGET_MODES:
            gap = (logps(model, mode, batch, grad=False, budget=args.budget) - reference)[completion].abs().max()
            assert gap < tolerance(ids), f"{mode} differs from TRL's pass by {gap}"
    forwards = len(PackedRows.build(ids, mask, width, max_tokens=args.budget, forward_tokens=args.budget).forwards)
    for mode in BUDGET_MODES:  # warm-up
        step(model, mode, batch, budget=args.budget)
    times = {mode: [] for mode in BUDGET_MODES}
    for repeat in range(args.repeats):
        order = BUDGET_MODES[repeat % len(BUDGET_MODES) :] + BUDGET_MODES[: repeat % len(BUDGET_MODES)]
        for mode in order:
            times[mode].append(step(model, mode, batch, budget=args.budget))
    print(
        f"rows {ids.size(0)}, real tokens {int(mask.sum())}, budget {args.budget} tokens: {forwards} forwards; "
        f"layer checkpointing {'on' if args.gradient_checkpointing else 'off'}"
    )
    print("| mode | step s (median) | vs `packed_budget` (median of ratios) | peak MiB |")
    print("|---|---|---|---|")
    results = {}
    for mode in BUDGET_MODES:
        median = statistics.median(times[mode])
        ratio = statistics.median(t_kept / t for t_kept, t in zip(times["packed_budget"], times[mode], strict=True))
        peak = peak_memory(args, mode, freed_at_once=True)
        results[mode] = {"step_s": median, "speedup": ratio, "peak_mib": peak}
        print(f"| `{mode}` | {median:.3f} | {ratio:.2f}x | {peak:.0f} |")
    print(json.dumps(results))


def zero3_main(args: argparse.Namespace) -> None:
    timed = launch_zero3(args, list(ZERO3_MODES))
    balance = timed["rank_imbalance"]
    print(
        f"2-process ZeRO-3, real tokens {timed['real']:.0f} over the ranks; rank imbalance (max/mean cost) "
        f"{balance['trl_placement']:.3f} as placed, {balance['balanced']:.3f} dealt by cost; the exchange "
        f"{timed['exchange_s'] * 1000:.1f} ms"
    )
    print(
        "| mode | step s (median) | vs trl_padded (median of ratios) | real tokens/s | positions | pad_frac | peak MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    results = {}
    for index, mode in enumerate(ZERO3_MODES):
        median = statistics.median(timed["times"][mode])
        pairs = zip(timed["times"]["trl_padded"], timed["times"][mode], strict=True)
        ratio = statistics.median(t_trl / t for t_trl, t in pairs)
        processed, padding = timed["positions"][index]
        peak = launch_zero3(args, [mode], peak=True)["peak_mib"]
        results[mode] = {"step_s": median, "speedup": ratio, "peak_mib": peak, "pad_frac": padding / processed}
        print(
            f"| `{mode}` | {median:.3f} | {ratio:.2f}x | {timed['real'] / median:.0f} | {processed:.0f} | "
            f"{padding / processed:.3f} | {peak:.0f} |"
        )
    print(json.dumps({"modes": results, "rank_imbalance": balance, "exchange_s": timed["exchange_s"]}))


def peak_memory(args: argparse.Namespace, mode: str, freed_at_once: bool = False) -> float:
    """``freed_at_once``: glibc maps every allocation above 64 KiB on its own, so a freed tensor leaves the RSS at
    once and the peak RSS is the peak of live tensors (otherwise the heap keeps freed blocks, and which mode's peak
    they inflate depends on the order of its frees)."""
    command = [sys.executable, __file__, "--worker", mode, *forwarded_flags(args)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536") if freed_at_once else None
    result = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_mib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-completion-len", type=int, default=512)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--zero3", action="store_true", help="2 processes under DeepSpeed ZeRO-3 (see above)")
    parser.add_argument("--port", type=int, default=29561, help="the ZeRO-3 launch's main process port")
    parser.add_argument(
        "--budget",
        type=int,
        help="compare packed rows under max_tokens_per_microbatch=BUDGET with the forwards' graphs kept and "
        "recomputed (recompute_forwards), and packed rows without a budget",
    )
    parser.add_argument("--gradient-checkpointing", action="store_true", help="layer checkpointing (TRL's default)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (1 process; peak memory: the allocator's)")
    for name, default in SHAPE.items():
        parser.add_argument(f"--{name}", type=int, default=default, help="the model's shape (see SHAPE)")
    parser.add_argument("--worker", choices=(*ZERO3_MODES, *BUDGET_MODES[1:]), help=argparse.SUPPRESS)
    parser.add_argument("--zero3-worker", help=argparse.SUPPRESS)
    parser.add_argument("--peak", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    SHAPE.update({name: getattr(args, name) for name in SHAPE})
    if args.device != "cpu" and (args.zero3 or args.zero3_worker):
        parser.error("--zero3 runs CPU processes over gloo (cpu_zero3.yaml): drop --device")
    if args.worker:
        peak_memory_worker(args)
        return
    if args.zero3_worker:
        zero3_worker(args)
        return
    if args.zero3:
        zero3_main(args)
        return
    if args.budget:
        budget_main(args)
        return

    model = build_model(args)
    batch = build_batch(args)
    ids, mask, width = batch
    completion = mask[:, -width:].bool()
    with torch.no_grad():
        reference = logps(model, "trl_padded", batch, grad=False)
        for mode in MODES[1:]:
            gap = (logps(model, mode, batch, grad=False) - reference)[completion].abs().max().item()
            assert gap < tolerance(ids), f"{mode} differs from TRL's pass by {gap}"
    real = int(mask.sum())
    positions = positions_of(batch)
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
