"""The ``trlx-scale`` command.

trlx-scale accelerate-config --nodes 2 --gpus-per-node 8 --backend zero3 --output zero3_2x8.yaml
trlx-scale accelerate-config --nodes 1 --gpus-per-node 4 --backend fsdp2 --vllm-tensor-parallel-size 3
    -> error: vllm_tensor_parallel_size (3) must divide gpus_per_node (4) ...
trlx-scale build-default-model --output /tmp/model
trlx-scale report outputs/grpo-addition                  # plots + report.md in outputs/grpo-addition/report
trlx-scale plan --params 7e9 --layers 32 --hidden 4096 --heads 32 --algo grpo --lora-rank 16 --gpus-per-node 1 --gpu a100-80
trlx-scale grpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K \
    --reward_funcs accuracy_reward --accelerate_config zero3     # as `trl grpo`; every config field is a flag
trlx-scale grpo                                              # the embedded model on the embedded task
trlx-scale recipes [list|show|check] [NAME ...]              # checked configurations for real models and GPUs
trlx-scale serve Qwen/Qwen3-0.6B --devices 4,5,6,7 --max-staleness 4   # a vLLM server for asynchronous GRPO
"""

from __future__ import annotations

import argparse
import sys

from .atomic_files import write_text_atomically
from .generation.serve_command import add_serve_parser
from .launch_config import BACKENDS, MAIN_NODE_IP_PLACEHOLDER, LaunchPlan
from .launch_training import TRAINING_COMMANDS
from .planning.command import add_plan_parser
from .recipe_check import add_recipes_parser
from .report.command import add_report_parser


def _accelerate_config(args: argparse.Namespace) -> int:
    plan = LaunchPlan(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        backend=args.backend,
        offload=args.offload,
        vllm_tensor_parallel_size=args.vllm_tensor_parallel_size,
        per_device_train_batch_size=args.per_device_train_batch_size,
        num_generations=args.num_generations,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        main_process_ip=args.main_process_ip,
        main_process_port=args.main_process_port,
    )
    try:
        text = plan.to_yaml()
    except ValueError as error:
        print(f"trlx-scale: {error}", file=sys.stderr)
        return 2
    if args.output == "-":
        sys.stdout.write(text)
    else:
        write_text_atomically(args.output, text)  # never a half-written config
        print(f"wrote {args.output}: {plan.world_size} processes, {args.backend}", file=sys.stderr)
    for note in plan.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


def _build_default_model(args: argparse.Namespace) -> int:
    from .tasks.default_model import build_default_model

    build_default_model(args.output, target_accuracy=args.target_accuracy, max_steps=args.max_steps)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trlx-scale", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    config = commands.add_parser("accelerate-config", help="write a checked Accelerate config for N nodes x G GPUs")
    config.add_argument("--nodes", type=int, default=1, help="number of nodes (machines)")
    config.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (= training processes) per node")
    config.add_argument(
        "--backend", choices=BACKENDS, default="ddp", help="data parallelism: ddp, fsdp2, zero2 or zero3"
    )
    config.add_argument("--offload", action="store_true", help="CPU offload (fsdp2: params; zero3: optimizer)")
    config.add_argument("--vllm-tensor-parallel-size", type=int, default=1, help="GPUs per colocated vLLM engine")
    config.add_argument("--per-device-train-batch-size", type=int, default=8, help="checked against the groups")
    config.add_argument("--num-generations", type=int, default=8, help="completions per prompt (GRPO group size)")
    config.add_argument("--gradient-accumulation-steps", type=int, default=1)
    config.add_argument("--main-process-ip", default=MAIN_NODE_IP_PLACEHOLDER, help="address of the rank-0 node")
    config.add_argument("--main-process-port", type=int, default=29500)
    config.add_argument("--output", default="-", help="file to write (atomically); '-' for standard output")
    config.set_defaults(handler=_accelerate_config)

    add_plan_parser(commands)
    add_report_parser(commands)
    add_recipes_parser(commands)
    add_serve_parser(commands)
    for name, algorithm in TRAINING_COMMANDS.items():
        commands.add_parser(name, help=f"train with {algorithm} (TRL's `trl {name}` flags; --help lists them)")

    model = commands.add_parser("build-default-model", help="rebuild the embedded default model (~2-5 min on CPU)")
    model.add_argument("--output", required=True)
    model.add_argument("--target-accuracy", type=float, default=0.4)
    model.add_argument("--max-steps", type=int, default=4000)
    model.set_defaults(handler=_build_default_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TRAINING_COMMANDS:
        # The training commands take the script's own flags (hundreds of config fields): parsed by the script.
        from .launch_training import run_training_command

        return run_training_command(argv[0], argv[1:])
    passthrough = []
    if argv and argv[0] == "serve" and "--" in argv:  # `trlx-scale serve MODEL -- <vLLM's own flags>`
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    if passthrough:
        args.vllm_args = passthrough
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
