"""``trlx-scale plan``: flags, the printed tables, ``--json`` and ``--write``.

    trlx-scale plan --model Qwen/Qwen2.5-7B --algo grpo --lora-rank 16 --gpus-per-node 1 --gpu a100-80
    trlx-scale plan --params 70e9 --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --vocab 128256 \\
        --algo ppo --nodes 8 --gpus-per-node 8 --gpu h100 --backend zero3 --offload --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys

from ..atomic_files import write_text_atomically
from .hardware import ACCELERATORS, resolve_accelerator
from .memory_model import ALGORITHMS, GIB, PLAN_BACKENDS, PRECISIONS, Plan, RunSpec
from .model_shape import ALL_LINEAR, ModelShape
from .planner import PlanReport, plan
from .resource_split import (
    assumed_generation_tokens_per_s,
    assumed_training_tokens_per_s,
    balance,
    continuous_optimum,
)

# The training command of each algorithm (installed with the package: no source checkout needed).
TRAINING_COMMANDS = {"grpo": "trlx-scale grpo", "ppo": "trlx-scale ppo", "dpo": "trlx-scale dpo"}


def add_plan_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "plan",
        help="per-GPU memory of every role of an RL run, per backend; the cheapest layout that fits",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = parser.add_argument_group("model (--model, or the shape)")
    model.add_argument("--model", help="local model directory or Hub id (its config.json is read)")
    model.add_argument("--params", type=float, help="total parameters, e.g. 70e9 (with --layers/--hidden/--heads)")
    model.add_argument("--layers", type=int, help="decoder layers")
    model.add_argument("--hidden", type=int, help="hidden size")
    model.add_argument("--heads", type=int, help="attention heads")
    model.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention; default: --heads)")
    model.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    model.add_argument("--intermediate", type=int, help="MLP width (default: derived from --params)")
    model.add_argument("--head-dim", type=int, help="head dimension (default: hidden / heads)")
    model.add_argument("--experts", type=int, default=1, help="MoE experts per layer (1: dense)")
    model.add_argument("--experts-per-token", type=int, default=1, help="MoE experts each token is routed to")
    model.add_argument("--tied-embeddings", action="store_true", help="LM head shares the embedding matrix")

    run = parser.add_argument_group("run")
    run.add_argument("--algo", choices=ALGORITHMS, default="grpo")
    run.add_argument("--lora-rank", type=int, help="LoRA rank (absent: full fine-tuning)")
    run.add_argument("--lora-targets", default=",".join(ALL_LINEAR), help="comma-separated LoRA target modules")
    run.add_argument("--critic-mode", choices=("separate", "shared_base"), default="separate", help="PPO critic")
    run.add_argument("--critic-lora", action="store_true", help="PPO: train the separate critic through LoRA")
    run.add_argument(
        "--reference", choices=("auto", "yes", "no"), default="auto", help="auto: PPO/DPO yes, GRPO no (beta=0)"
    )
    run.add_argument("--reward-model-params", type=float, help="parameters of a reward model (absent: functions)")
    run.add_argument("--prompt-length", type=int, default=512)
    run.add_argument("--completion-length", type=int, default=512)
    run.add_argument("--micro-batch", type=int, default=4, help="sequences per GPU per forward (DPO: pairs)")
    run.add_argument("--generation-batch", type=int, help="sequences one engine generates per rollout")
    run.add_argument("--num-generations", type=int, default=8, help="completions per prompt (GRPO group)")
    run.add_argument("--no-gradient-checkpointing", action="store_true")
    run.add_argument(
        "--max-tokens-per-microbatch",
        type=int,
        help="packed (padding_free) passes: the most tokens of one forward (the field of that name); with "
        "--recompute-forwards (the default) it bounds the activations and logits a micro-batch holds, else only the "
        "layer recomputed under gradient checkpointing",
    )
    run.add_argument(
        "--recompute-forwards",
        choices=("auto", "true", "false"),
        default="auto",
        help="the field of that name: 'auto' recomputes the packed forwards in the backward where "
        "--max-tokens-per-microbatch is set (not under zero3, where the trainer refuses it)",
    )
    run.add_argument("--precision", choices=PRECISIONS, default="bf16-master", help="bf16-master: the presets")

    engine = parser.add_argument_group("colocated vLLM engine")
    engine.add_argument("--no-vllm", action="store_true", help="generate with the trainer's model (no engine)")
    engine.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    engine.add_argument("--vllm-tp", type=int, default=1, help="tensor-parallel size of each engine")
    engine.add_argument("--vllm-dtype", choices=("bf16", "fp32"), default="bf16")
    engine.add_argument("--no-sleep", action="store_true", help="engine keeps its memory during training")
    engine.add_argument("--sleep-level", type=int, choices=(1, 2), help="default: 1 with LoRA, 2 for full")

    hardware = parser.add_argument_group("hardware and backend")
    hardware.add_argument("--nodes", type=int, default=1)
    hardware.add_argument("--gpus-per-node", type=int, default=8)
    hardware.add_argument("--gpu", help=f"one of {', '.join(ACCELERATORS)} (else give --gpu-memory-gb)")
    hardware.add_argument("--gpu-memory-gb", type=float, help="memory per GPU in GiB (overrides --gpu's)")
    hardware.add_argument("--backend", action="append", choices=PLAN_BACKENDS, help="repeatable; default: all of them")
    hardware.add_argument("--offload", action="store_true", help="also plan CPU offload (ZeRO: optimizer; FSDP2: all)")
    hardware.add_argument("--overhead-gib", type=float, default=2.0, help="per-GPU runtime margin (CUDA context...)")

    split = parser.add_argument_group("disaggregated generation (GPU split)")
    split.add_argument("--gen-tokens-per-s", type=float, help="measured generation tokens/s per GPU")
    split.add_argument("--train-tokens-per-s", type=float, help="measured training tokens/s per GPU")

    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    output.add_argument("--write", metavar="DIR", help="write the recommended Accelerate YAML and launch command")
    parser.set_defaults(handler=run_plan)
    return parser


def model_from_args(args: argparse.Namespace) -> ModelShape:
    if args.model:
        return ModelShape.from_pretrained(args.model)
    missing = [f"--{n}" for n in ("layers", "hidden", "heads") if getattr(args, n) is None]
    if missing:
        raise ValueError(f"Give --model PATH_OR_ID, or the shape: {', '.join(missing)} missing (and --params).")
    return ModelShape(
        params=args.params,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        intermediate=args.intermediate,
        head_dim=args.head_dim,
        experts=args.experts,
        experts_per_token=args.experts_per_token,
        tied_embeddings=args.tied_embeddings,
        name="explicit shape",
    ).complete()


def run_spec_from_args(args: argparse.Namespace, model: ModelShape) -> RunSpec:
    reward = None
    if args.reward_model_params:
        reward = ModelShape(
            params=args.reward_model_params, layers=model.layers, hidden=model.hidden, heads=model.heads
        )
    return RunSpec(
        model=model,
        algo=args.algo,
        lora_rank=args.lora_rank,
        lora_targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()),
        critic_mode=args.critic_mode,
        critic_lora=args.critic_lora,
        reference={"auto": None, "yes": True, "no": False}[args.reference],
        reward_model=reward,
        prompt_length=args.prompt_length,
        completion_length=args.completion_length,
        micro_batch=args.micro_batch,
        generation_batch=args.generation_batch,
        num_generations=args.num_generations,
        gradient_checkpointing=not args.no_gradient_checkpointing,
        max_tokens_per_microbatch=args.max_tokens_per_microbatch,
        recompute_forwards=args.recompute_forwards,
        precision=args.precision,
        vllm=not args.no_vllm and args.algo != "dpo",  # offline DPO generates nothing
        vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        vllm_dtype_bytes=2 if args.vllm_dtype == "bf16" else 4,
        vllm_tensor_parallel_size=args.vllm_tp,
        vllm_sleep=not args.no_sleep,
        vllm_sleep_level=args.sleep_level,
        runtime_overhead_gib=args.overhead_gib,
    )


def run_plan(args: argparse.Namespace) -> int:
    try:
        accelerator = resolve_accelerator(args.gpu, args.gpu_memory_gb)
        model = model_from_args(args)
        run = run_spec_from_args(args, model)
        backends = tuple(args.backend) if args.backend else PLAN_BACKENDS
        report = plan(run, accelerator, args.nodes, args.gpus_per_node, backends, args.offload)
        split = split_summary(args, report)
    except ValueError as error:
        print(f"trlx-scale plan: {error}", file=sys.stderr)
        return 2
    result = report.as_dict()
    if split is not None:
        result["disaggregated_split"] = split
    if args.write:
        try:
            result["written"] = write_launch_files(args, report)
        except ValueError as error:
            print(f"trlx-scale plan: --write: {error}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render(report, split, result.get("written")))
    return 0


# ---------------------------------------------------------------------------------------------- output
def _gib(value: float) -> str:
    return f"{value / GIB:7.2f}" if value else "      -"


def render_plan(p: Plan) -> str:
    layout = p.layout
    title = (
        f"{layout.backend}{' + offload' if layout.offload else ''} on {layout.nodes} node(s) x "
        f"{layout.gpus_per_node} GPU(s): "
        + (
            f"FITS, peak {p.per_gpu_gib:.1f} of {p.gpu_memory_gib:g} GiB per GPU, headroom {p.headroom_gib:.1f} GiB"
            if p.fits
            else f"CANNOT START, peak {p.per_gpu_gib:.1f} of {p.gpu_memory_gib:g} GiB per GPU (see below)"
            if p.blockers
            else f"DOES NOT FIT, peak {p.per_gpu_gib:.1f} of {p.gpu_memory_gib:g} GiB per GPU "
            f"({-p.headroom_gib:.1f} GiB over)"
        )
    )
    width = max(len(r.role) for r in p.roles) + 2
    lines = [title, f"  {'role':<{width}}{'train GiB':>10}{'generate':>10}{'host GiB':>10}  formula"]
    for r in p.roles:
        lines.append(
            f"  {r.role:<{width}}{_gib(r.training):>10}{_gib(r.generation):>10}{_gib(r.host):>10}  {r.formula}"
        )
    lines.append(
        f"  {'total per GPU':<{width}}{p.training_gib:10.2f}{p.generation_gib:10.2f}{p.host_gib:10.2f}"
        "  peak = the larger phase"
    )
    lines += [f"  note: {n}" for n in p.notes]
    lines += [f"  CANNOT START: {b}" for b in p.blockers]
    return "\n".join(lines)


def engine_assumption(run) -> str:
    """What the plan assumes of the colocated engine, in the config's words: the trainer's own default keeps the
    engine's memory during training (vllm_enable_sleep_mode=False), so a plan that counts on sleep says so."""
    if not run.uses_engine:
        return "assumes: no vLLM engine in the training processes"
    if run.vllm_sleep:
        level = run.sleep_level
        return (
            f"assumes: vllm_enable_sleep_mode=True, vllm_sleep_level={level} (the engine frees its GPU memory "
            "during training; the config's default, False, keeps it: set both, or plan with --no-sleep)"
        )
    return "assumes: vllm_enable_sleep_mode=False (the engine keeps its GPU memory during training)"


def render(report: PlanReport, split: dict | None, written: dict | None) -> str:
    model = report.run.model.complete()
    run = report.run
    head = (
        f"{model.name}: {model.total_params / 1e9:.2f}B params ({model.layers} layers, hidden {model.hidden}, "
        f"{model.heads} heads / {model.kv} KV, vocab {model.vocab})\n"
        f"{run.algo}, {'LoRA r' + str(run.lora_rank) if run.lora_rank else 'full fine-tuning'}, "
        f"{run.precision}, micro-batch {run.micro_batch} x ({run.prompt_length}+{run.completion_length}) tokens, "
        f"checkpointing {'on' if run.gradient_checkpointing else 'off'}, "
        f"{'colocated vLLM' if run.uses_engine else 'no vLLM engine'}; GPU {report.accelerator.name} "
        f"({report.accelerator.memory_gib:g} GiB)"
    )
    parts = [head, engine_assumption(run), ""] + [render_plan(p) + "\n" for p in report.plans]
    rec = report.recommendation
    if rec is None:
        parts.append("recommendation: nothing fits on up to this many GPUs; add GPUs, LoRA, --offload, or shorten.")
    else:
        lay = rec.layout
        parts.append(
            f"recommendation: {lay.backend}{' + offload' if lay.offload else ''} on {lay.nodes} x {lay.gpus_per_node} "
            f"GPU(s) ({lay.gpus} in all), peak {rec.per_gpu_gib:.1f} GiB per GPU"
        )
    if split is not None:
        parts.append(
            f"disaggregated split ({split['source']} throughputs): {split['generation_gpus']} GPU(s) generate, "
            f"{split['training_gpus']} train; step {split['step_seconds']:.3g} s (generation "
            f"{split['generation_seconds']:.3g} s, training {split['training_seconds']:.3g} s)"
        )
    if written:
        parts.append(f"wrote {written['config']} and {written['launch']}:\n  {written['command']}")
    return "\n".join(parts)


def split_summary(args: argparse.Namespace, report: PlanReport) -> dict | None:
    """The generation/training GPU split for all GPUs of the run (measured throughputs, else assumed ones)."""
    total = args.nodes * args.gpus_per_node
    if total < 2 or not report.run.uses_engine:
        return None
    run, model, acc = report.run, report.run.model.complete(), report.accelerator
    prompts = run.generation_batch or run.micro_batch
    sequences_per_step = total * prompts
    generated = sequences_per_step * run.completion_length
    trained = sequences_per_step * (run.prompt_length + run.completion_length)
    rg, rt, source = args.gen_tokens_per_s, args.train_tokens_per_s, "measured"
    if rg is None or rt is None:
        if acc.bf16_tflops is None or acc.bandwidth_tb_s is None:
            return None  # nothing to assume from on an unknown device
        source = "assumed (40% MFU training; bandwidth-bound decoding)"
        rt = rt or assumed_training_tokens_per_s(model.active_params, acc.bf16_tflops)
        rg = rg or assumed_generation_tokens_per_s(
            model.total_params * run.vllm_dtype_bytes, acc.bandwidth_tb_s, prompts
        )
    best = balance(total, generated, trained, rg, rt, run.vllm_tensor_parallel_size)
    return {
        "source": source,
        "generation_tokens_per_s_per_gpu": rg,
        "training_tokens_per_s_per_gpu": rt,
        "generation_gpus": best.generation_gpus,
        "training_gpus": best.training_gpus,
        "continuous_optimum_generation_gpus": round(continuous_optimum(total, generated, trained, rg, rt), 3),
        "generation_seconds": best.generation_seconds,
        "training_seconds": best.training_seconds,
        "step_seconds": best.step_seconds,
    }


def write_launch_files(args: argparse.Namespace, report: PlanReport) -> dict:
    """The recommended layout as an Accelerate YAML (through launch_config) and the launch command, atomically."""
    from ..launch_config import LaunchPlan

    rec = report.recommendation
    if rec is None:
        raise ValueError("nothing fits, so there is no configuration to write; see the tables.")
    lay, run = rec.layout, report.run
    grouped = run.algo in ("grpo", "ppo", "online-dpo")
    # The smallest accumulation that makes each generation batch hold whole groups of num_generations.
    accumulation = run.num_generations // math.gcd(run.num_generations, run.micro_batch * lay.gpus) if grouped else 1
    launch = LaunchPlan(
        nodes=lay.nodes,
        gpus_per_node=lay.gpus_per_node,
        backend=lay.backend,
        offload=lay.offload,
        vllm_tensor_parallel_size=run.vllm_tensor_parallel_size,
        # Only the GRPO-style group check reads these; an offline DPO batch has no groups to complete.
        per_device_train_batch_size=run.micro_batch if grouped else 2,
        num_generations=run.num_generations if grouped else 2,
        gradient_accumulation_steps=accumulation,
    )
    text = launch.to_yaml()
    os.makedirs(args.write, exist_ok=True)
    name = f"accelerate_{lay.backend}{'_offload' if lay.offload else ''}_{lay.nodes}x{lay.gpus_per_node}.yaml"
    config_path = os.path.join(args.write, name)
    training = TRAINING_COMMANDS["dpo" if run.algo in ("dpo", "online-dpo") else run.algo]
    flags = [
        f"--per_device_train_batch_size {run.micro_batch}",
        f"--gradient_checkpointing {run.gradient_checkpointing}",
    ]
    if run.algo == "online-dpo":
        flags.insert(0, "--online")
    if accumulation > 1:
        flags.append(f"--gradient_accumulation_steps {accumulation}")
    if run.algo in ("grpo", "ppo"):
        flags.append(f"--num_generations {run.num_generations}")
        flags.append(f"--max_completion_length {run.completion_length}")
    if args.model:
        flags.insert(0, f"--model_name_or_path {shlex.quote(args.model)}")
    flags.append(f"--use_peft true --lora_r {run.lora_rank}" if run.lora_rank else "--use_peft false")
    machine = " --machine_rank $NODE_RANK" if lay.nodes > 1 else ""
    command = f"{training} --accelerate_config {config_path}{machine} " + " ".join(flags)
    launch_path = os.path.join(args.write, "launch.sh")
    body = (
        "#!/usr/bin/env bash\n# Written by `trlx-scale plan --write`"
        + (" (run on every node with NODE_RANK set)" if lay.nodes > 1 else "")
        + f": peak {rec.per_gpu_gib:.1f} GiB per GPU planned.\nset -euo pipefail\n{command}\n"
    )
    for path, content in ((config_path, text), (launch_path, body)):
        write_text_atomically(path, content)  # never a half-written file
    os.chmod(launch_path, 0o755)
    return {"config": config_path, "launch": launch_path, "command": command}
