"""The asynchronous trainer's side for real, under FSDP2, against the simulated engine (issue #40, item 8).

``benchmarks/async_grpo.py --simulated`` drives the real ``RolloutProducer`` with a simulated engine *and* a simulated
trainer (a sleep). Here the trainer is real: each step takes its groups from the producer, runs a GRPO-like
forward/backward/optimizer step of a real-shaped model (Qwen2-0.5B's shape by default, random init, fp32 masters,
bf16 compute, every decoder layer and the root sharded with FSDP2 ``fully_shard`` in a one-process group, the
package's ``fsdp2_mixed_precision_policy``), on the simulated completions' token ids mapped into the vocabulary, then
the weight sync's gather (the package's ``server_weights.gathered_full_weights``: what ``FullWeightFilesTransport``
gathers from an FSDP2 model before writing the file a server reloads), then publishes the next version to the
engine and the producer. The loss is the package's ``clipped_policy_loss`` with group-normalised advantages of a
reward computed from the token ids (the reward does not matter here, the shapes and the timing do).

The engine: ``SimulatedEngine`` (``--slots`` groups at once, log-normal group times with ``--sigma``). Its mean
group time is calibrated so that a step's generation (its groups' time summed over the slots) is on average
``--gen-ratio`` times the measured training step (train + sync): the regime where overlap matters most.

Reported per ``max_staleness`` (0 = synchronous, then 1, 2, 4): seconds per step (the median of the steps after
``--warmup``, and the mean over them), the training part and the sync gather (medians), the trainer's idle fraction
(``async/trainer_idle_frac``: time blocked in ``take``) and the generator's (``async/generator_idle_frac``), the
staleness the producer reports, the bound max(mean generation, mean train + sync) per step, tokens trained per
second, and the peak GPU memory (``torch.cuda.max_memory_reserved``, and allocated).

    python benchmarks/async_fsdp2_gpu.py --out /tmp/async_fsdp2.json                  # a GPU, Qwen2-0.5B shape
    python benchmarks/async_fsdp2_gpu.py --device cpu --tiny --steps 5 --warmup 1     # a smoke test on CPU

Imports only torch, transformers and trlx_scale modules that need neither TRL, datasets nor vLLM. Results and the
command: docs/benchmarks.md ("On a GPU (H200): the device check").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.helpers.policy_loss_reference import clipped_policy_loss  # noqa: E402
from tests.helpers.simulated_engine import SimulatedEngine, lognormal_duration  # noqa: E402
from trlx_scale.generation.server_weights import gathered_full_weights  # noqa: E402
from trlx_scale.generation.weight_sync import is_fsdp2_sharded  # noqa: E402
from trlx_scale.optim.distributed_precision import fsdp2_mixed_precision_policy  # noqa: E402
from trlx_scale.optim.presets import get_preset  # noqa: E402
from trlx_scale.rollout.async_producer import RolloutProducer, group_seed  # noqa: E402
from trlx_scale.rollout.staleness import StalenessSchedule  # noqa: E402

# Qwen2-0.5B's shape (its config.json), random init: no download.
QWEN2_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a 2-layer model and short sequences (a CPU smoke test)")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--steps", type=int, default=12, help="steps per max_staleness setting")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing, per setting")
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=896, help="longest completion (tokens)")
    p.add_argument("--min-completion-len", type=int, default=64)
    p.add_argument("--slots", type=int, default=8, help="groups the simulated engine runs at once")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the group times")
    p.add_argument(
        "--gen-ratio",
        type=float,
        default=1.0,
        help="mean generation per step / measured training step (calibrates the engine's group time)",
    )
    p.add_argument("--mean-group-time", type=float, default=None, help="seconds; overrides the calibration")
    p.add_argument("--calibrate-steps", type=int, default=3)
    p.add_argument(
        "--sync",
        default="gather",
        choices=["gather", "none"],
        help="gather: time server_weights.gathered_full_weights each step (on the step's path)",
    )
    p.add_argument("--no-bf16", action="store_true", help="fp32 compute (no mixed-precision policy)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    cli = p.parse_args(argv)
    if cli.tiny:
        cli.prompt_len, cli.completion_len, cli.min_completion_len = 16, 48, 8
        cli.groups_per_step, cli.num_generations, cli.micro_batch, cli.slots = 4, 4, 8, 4
    if cli.steps <= cli.warmup + 1:
        p.error("--steps must exceed --warmup + 1")
    return cli


def init_process_group(device: str) -> None:
    """A one-process group (FSDP2 needs one): NCCL on a GPU, gloo on CPU."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs = {"device_id": torch.device("cuda", 0)} if device == "cuda" else {}
    dist.init_process_group(backend=backend, rank=0, world_size=1, **kwargs)


def build_model(cli: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    """A Qwen2-shaped causal LM from its config (random init, fp32 masters), every decoder layer and the root
    sharded with ``fully_shard`` and the package's mixed-precision policy (bf16 compute, fp32 reduction)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = TINY if cli.tiny else QWEN2_05B
    config = Qwen2Config(**shape, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(cli.seed)
    with torch.device(cli.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mesh = init_device_mesh(cli.device, (1,))
    kwargs = {"mesh": mesh}
    if not cli.no_bf16:
        kwargs["mp_policy"] = fsdp2_mixed_precision_policy()
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    assert is_fsdp2_sharded(model)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    return model, {"model_shape": "tiny" if cli.tiny else "Qwen2-0.5B", "parameters": n_params, **shape}


def completion_lengths(seed: int, count: int, cli: argparse.Namespace) -> list[int]:
    """Ragged completion lengths, a function of the group's seed (long-tailed: most short, a few at the cap)."""
    rng = random.Random(seed ^ 0x5EED)
    lengths = []
    for _ in range(count):
        x = rng.lognormvariate(0.0, 0.8) / 3.0
        lengths.append(max(cli.min_completion_len, min(cli.completion_len, int(cli.completion_len * x))))
    return lengths


def group_batch(groups, cli: argparse.Namespace, vocab: int):
    """(input_ids, completion mask, rewards) rows of every completion of ``groups``: the engine's ids mapped into
    the vocabulary, a prompt per group, right padding. Rewards: the fraction of even token ids (any function of the
    ids would do)."""
    rows, masks, rewards = [], [], []
    total = cli.prompt_len + cli.completion_len
    for group in groups:
        prng = random.Random(group.index)
        prompt = [prng.randrange(vocab) for _ in range(cli.prompt_len)]
        lengths = completion_lengths(group.request.seed, len(group.sampled.completion_ids), cli)
        for ids, length, reward in zip(group.sampled.completion_ids, lengths, group.rewards, strict=True):
            completion = [(tok * 1511 + 97 * j + group.index) % vocab for j, tok in enumerate(ids[:length])]
            pad = total - cli.prompt_len - len(completion)
            rows.append(prompt + completion + [0] * pad)
            masks.append([0] * cli.prompt_len + [1] * len(completion) + [0] * pad)
            rewards.append(reward[0])
    return torch.tensor(rows), torch.tensor(masks), torch.tensor(rewards, dtype=torch.float32)


def train_step(model, optimizer, groups, cli, vocab: int) -> dict[str, float]:
    """One GRPO-like step on ``groups``: group-normalised advantages, clipped surrogate (one iteration per step:
    old log-probs = the current ones, detached, as TRL computes them), gradient accumulation over micro-batches,
    one optimizer step."""
    device = torch.device(cli.device)
    ids, mask, rewards = group_batch(groups, cli, vocab)
    g = cli.num_generations
    grouped = rewards.view(-1, g)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    # Trim the padding every row shares, as a collator would.
    used = int(mask.sum(0).nonzero().max()) + 1
    ids, mask = ids[:, :used], mask[:, :used]
    n = ids.shape[0]
    tokens = int(mask.sum()) + n * cli.prompt_len
    loss_total = 0.0
    for start in range(0, n, cli.micro_batch):
        mb_ids = ids[start : start + cli.micro_batch].to(device, non_blocking=True)
        mb_mask = mask[start : start + cli.micro_batch].to(device, non_blocking=True)
        mb_adv = advantages[start : start + cli.micro_batch].to(device)
        attention = torch.ones_like(mb_ids)
        attention[:, cli.prompt_len :] = mb_mask[:, cli.prompt_len :]
        logits = model(input_ids=mb_ids, attention_mask=attention).logits[:, cli.prompt_len - 1 : -1]
        targets = mb_ids[:, cli.prompt_len :]
        logits = logits.float()
        logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        del logits
        comp_mask = mb_mask[:, cli.prompt_len :].float()
        loss, _ = clipped_policy_loss(logps, logps.detach(), mb_adv, comp_mask, 0.2, 0.28, aggregation="token_mean")
        loss = loss * (mb_ids.shape[0] / n)
        loss.backward()
        loss_total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss_total, "tokens": tokens, "sequences": n}


def sync_weights(model, cli) -> float:
    """The weight sync's gather (``gathered_full_weights``: every tensor ``full_tensor``-gathered, kept on CPU, as
    ``FullWeightFilesTransport`` gathers an FSDP2 policy before writing it); seconds."""
    if cli.sync == "none":
        return 0.0
    _sync(cli)
    began = time.perf_counter()
    with torch.no_grad():
        tensors = gathered_full_weights(model, keep=True)
    _sync(cli)
    seconds = time.perf_counter() - began
    del tensors
    return seconds


def _sync(cli) -> None:
    if cli.device == "cuda":
        torch.cuda.synchronize()


class _FakeGroup:
    """A stand-in for a ScoredGroup in the calibration steps (no producer yet)."""

    def __init__(self, index: int, seed: int, cli):
        rng = random.Random(seed)
        ids = [[rng.randrange(100) for _ in range(cli.completion_len)] for _ in range(cli.num_generations)]
        self.index = index
        self.request = type("R", (), {"seed": seed})()
        self.sampled = type("S", (), {"completion_ids": ids})()
        self.rewards = [[_reward(c)] for c in ids]


def _reward(ids: list[int]) -> float:
    return sum(1 for t in ids if t % 2 == 0) / max(1, len(ids))


async def _score(request, sampled):
    return [[_reward(ids)] for ids in sampled.completion_ids]


def calibrate(model, optimizer, cli, vocab: int) -> dict[str, float]:
    """Seconds of a training step (and its sync) on typical groups, before the producer exists."""
    times, trains, syncs = [], [], []
    for step in range(cli.calibrate_steps):
        groups = [
            _FakeGroup(step * cli.groups_per_step + i, 1000 + step * 97 + i, cli) for i in range(cli.groups_per_step)
        ]
        _sync(cli)
        began = time.perf_counter()
        train_step(model, optimizer, groups, cli, vocab)
        _sync(cli)
        trained = time.perf_counter() - began
        synced = sync_weights(model, cli)
        times.append(trained + synced)
        trains.append(trained)
        syncs.append(synced)
    keep = times[1:] or times  # the first step pays for the allocator and kernel selection
    return {
        "step_s": statistics.median(keep),
        "train_s": statistics.median(trains[1:] or trains),
        "sync_s": statistics.median(syncs[1:] or syncs),
    }


def run_setting(model, optimizer, cli, vocab: int, max_staleness: int, mean_group_time: float) -> dict:
    engine = SimulatedEngine(
        slots=cli.slots, mean_group_time=mean_group_time, sigma=cli.sigma, completion_length=cli.completion_len
    )
    schedule = StalenessSchedule(groups_per_version=cli.groups_per_step, max_staleness=max_staleness)
    producer = RolloutProducer(
        prompt_for=lambda index: index,
        sampler=engine,
        score=_score,
        schedule=schedule,
        num_generations=cli.num_generations,
        seed=cli.seed,
        max_inflight_tasks=cli.slots * (max_staleness + 1),
        queue_maxsize=cli.groups_per_step * (max_staleness + 1),
    )
    if cli.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    step_ends, durations, trains, syncs, takes, tokens = [], [], [], [], [], []
    trainer_idle, generator_idle, staleness = [], [], []
    producer.start()
    try:
        engine.publish(0)
        producer.publish_version(0)
        began = time.perf_counter()
        last = began
        for step in range(cli.steps):
            t0 = time.perf_counter()
            groups = producer.take(cli.groups_per_step, timeout=600)
            t1 = time.perf_counter()
            staleness.extend(group.staleness for group in groups)
            stats = train_step(model, optimizer, groups, cli, vocab)
            _sync(cli)
            t2 = time.perf_counter()
            synced = sync_weights(model, cli)
            engine.publish(step + 1)
            producer.publish_version(step + 1)
            now = time.perf_counter()
            metrics = producer.pop_metrics()
            step_ends.append(now - began)
            if step >= cli.warmup:
                durations.append(now - last)
                takes.append(t1 - t0)
                trains.append(t2 - t1)
                syncs.append(synced)
                tokens.append(stats["tokens"])
                trainer_idle.append(metrics["async/trainer_idle_frac"])
                generator_idle.append(metrics["async/generator_idle_frac"])
            last = now
            print(
                f"  staleness {max_staleness} step {step}: {now - t0:.3f} s (take {t1 - t0:.3f}, train "
                f"{t2 - t1:.3f}, sync {synced:.3f}), loss {stats['loss']:+.4f}, {stats['tokens']} tokens",
                flush=True,
            )
    finally:
        producer.close()
    # Generation per step, as benchmarks/async_grpo.py computes it: the step's group times summed over the slots.
    generation = []
    for step in range(cli.warmup, cli.steps):
        indices = range(step * cli.groups_per_step, (step + 1) * cli.groups_per_step)
        total = sum(
            lognormal_duration(group_seed(cli.seed, schedule.sampled_at(k), k), mean_group_time, cli.sigma)
            for k in indices
        )
        generation.append(total / cli.slots)
    steady = (
        (step_ends[-1] - step_ends[cli.warmup - 1]) / (cli.steps - cli.warmup)
        if cli.warmup
        else (step_ends[-1] / cli.steps)
    )
    train_and_sync = statistics.mean(t + s for t, s in zip(trains, syncs, strict=True))
    result = {
        "max_staleness": max_staleness,
        "s_per_step_median": statistics.median(durations),
        "s_per_step_mean": steady,
        "train_s_median": statistics.median(trains),
        "sync_gather_s_median": statistics.median(syncs),
        "take_s_median": statistics.median(takes),
        "trainer_idle_frac": statistics.mean(trainer_idle),
        "generator_idle_frac": statistics.mean(generator_idle),
        "staleness_mean": statistics.mean(staleness),
        "staleness_max": max(staleness),
        "generation_s_per_step_mean": statistics.mean(generation),
        "run_bound_s_per_step": max(statistics.mean(generation), train_and_sync),
        "tokens_per_s": sum(tokens) / sum(durations),
    }
    result["bound_over_achieved"] = result["run_bound_s_per_step"] / result["s_per_step_mean"]
    if cli.device == "cuda":
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def _row(r: dict) -> str:
    peak = f"{r['peak_reserved_gib']:.2f}" if "peak_reserved_gib" in r else "-"
    speedup = f"{r['speedup_over_staleness0']:.2f}x" if r.get("speedup_over_staleness0") else "-"
    return (
        f"| {r['max_staleness']} | {r['s_per_step_median']:.3f} | {r['s_per_step_mean']:.3f} "
        f"| {r['run_bound_s_per_step']:.3f} | {r['bound_over_achieved']:.2f} | {r['train_s_median']:.3f} "
        f"| {r['sync_gather_s_median']:.3f} | {r['trainer_idle_frac']:.2f} | {r['generator_idle_frac']:.2f} "
        f"| {r['staleness_mean']:.2f}/{r['staleness_max']} | {r['tokens_per_s']:.0f} | {speedup} | {peak} |"
    )


def _write(path: str | None, report: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        json.dump(report, handle, indent=2)
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    cli = parse_args(argv)
    if cli.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu", file=sys.stderr)
        return 2
    if cli.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    init_process_group(cli.device)
    try:
        started = time.perf_counter()
        model, shape = build_model(cli)
        preset = get_preset("grpo")
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=preset.learning_rate,
            betas=(preset.adam_beta1, preset.adam_beta2),
            eps=preset.adam_epsilon,
            weight_decay=preset.weight_decay,
        )
        vocab = shape["vocab_size"]
        built = time.perf_counter() - started
        calibration = calibrate(model, optimizer, cli, vocab)
        mean_group_time = cli.mean_group_time or (
            cli.gen_ratio * calibration["step_s"] * cli.slots / cli.groups_per_step
        )
        print(
            f"model {shape['model_shape']} ({shape['parameters'] / 1e6:.1f}M parameters) built and sharded in "
            f"{built:.1f} s; calibrated step {calibration['step_s']:.3f} s (train {calibration['train_s']:.3f}, "
            f"sync gather {calibration['sync_s']:.3f}); engine mean group time {mean_group_time:.3f} s on "
            f"{cli.slots} slots",
            flush=True,
        )
        environment = {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device_name": torch.cuda.get_device_name(0) if cli.device == "cuda" else platform.processor() or "cpu",
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        }
        try:
            import transformers

            environment["transformers"] = transformers.__version__
        except Exception:  # noqa: BLE001
            pass
        results: list[dict] = []
        report = {
            "command": " ".join([os.path.relpath(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
            "environment": environment,
            "model": shape,
            "settings": {k: v for k, v in vars(cli).items() if k != "out"},
            "calibration": calibration,
            "mean_group_time_s": mean_group_time,
            "results": results,
            "complete": False,
        }
        for max_staleness in cli.staleness:
            result = run_setting(model, optimizer, cli, vocab, max_staleness, mean_group_time)
            base = next((r for r in results + [result] if r["max_staleness"] == 0), None)
            result["speedup_over_staleness0"] = base["s_per_step_mean"] / result["s_per_step_mean"] if base else None
            results.append(result)
            print("RESULT " + _row(result), flush=True)
            # Written after every setting: a run stopped by its time limit still leaves the settings it finished.
            report["complete"] = len(results) == len(cli.staleness)
            _write(cli.out, report)
        print()
        print(
            "| max_staleness | s/step (median) | s/step (mean) | bound s/step | bound/achieved | train s | sync gather s "
            "| trainer idle | generator idle | staleness mean/max | tokens/s | speed-up | peak reserved GiB |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in results:
            print(_row(r))
        if cli.out:
            print(f"\nwrote {cli.out}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
