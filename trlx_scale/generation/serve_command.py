"""``trlx-scale serve MODEL``: a vLLM server set up for asynchronous GRPO, in the foreground.

    trlx-scale serve Qwen/Qwen3-0.6B --port 8000 --devices 4,5,6,7 --max-staleness 4
    trlx-scale serve                      # the embedded default model, on CPU here

It starts the server with what the asynchronous trainer needs (``vllm_server.ServerLaunch``: runtime LoRA with
enough adapter slots for ``--max-staleness``, the weight-reload endpoints, the engine's log-probs of the sampled
distribution), waits until it answers, prints its URL and the trainer settings that use it, and stops it (and its
engine processes) on Ctrl-C. ``--dry-run`` prints the command without starting anything; flags after ``--`` go to
vLLM itself (``trlx-scale serve MODEL -- --tensor-parallel-size 4``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time


def lora_slots(max_staleness: int) -> int:
    """Adapter slots for ``max_staleness``: every version a sample in flight may use, plus the one being loaded."""
    return max_staleness + 2


def _serve(args: argparse.Namespace) -> int:
    from .cpu_environment import running_on_cpu_only
    from .vllm_server import ServerLaunch, VLLMServerProcess, VLLMServerStartError

    model = args.model
    if model is None:
        from ..tasks.default_model import default_model_path

        model = default_model_path()
    if args.max_staleness < 0:
        print(f"trlx-scale serve: --max-staleness must be >= 0, got {args.max_staleness}.", file=sys.stderr)
        return 2
    dtype = args.dtype or ("float32" if running_on_cpu_only() else "auto")
    launch = ServerLaunch(
        model=model,
        host=args.host,
        port=args.port,
        dtype=dtype,
        max_model_len=args.max_model_len,
        enable_lora=not args.no_lora,
        max_loras=lora_slots(args.max_staleness),
        max_lora_rank=args.max_lora_rank,
        seed=args.seed,
        devices=args.devices,
        extra_args=args.vllm_args,
    )
    if args.dry_run:
        print(launch.shell_command())
        return 0
    server = VLLMServerProcess(launch, startup_timeout=args.startup_timeout, log_path=args.log)
    print(f"starting: {launch.shell_command()}\nlog: {server.log_path}", file=sys.stderr)
    try:
        server.start()
    except VLLMServerStartError as error:
        print(f"trlx-scale serve: {error}", file=sys.stderr)
        return 1
    print(f"serving {model} at {launch.url}")
    print(
        f'trainer settings: AsyncGRPOConfig(vllm_server_base_url="{launch.url}", max_staleness={args.max_staleness})'
    )
    stop = {"now": False}

    def request_stop(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, request_stop)
    try:
        while not stop["now"]:
            if not server.alive():
                print(f"trlx-scale serve: {server.exit_report()}", file=sys.stderr)
                return 1
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def add_serve_parser(commands) -> None:
    serve = commands.add_parser("serve", help="a vLLM server for asynchronous GRPO (runtime LoRA, weight reloads)")
    serve.add_argument("model", nargs="?", default=None, help="Hub id or path (default: the embedded model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for other nodes)")
    serve.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    serve.add_argument("--devices", default=None, help="CUDA_VISIBLE_DEVICES of the server (its own GPUs)")
    serve.add_argument(
        "--dtype",
        default=None,
        help="vLLM --dtype, to match the trainer's compute dtype (default: float32 on CPU, where vLLM's 'auto' "
        "loads an fp32 checkpoint in bfloat16 and its log-probs then differ from the trainer's by ~1e-2; else auto)",
    )
    serve.add_argument("--max-model-len", type=int, default=None, help="prompt + completion tokens at most")
    serve.add_argument("--max-staleness", type=int, default=4, help="the trainer's max_staleness (adapter slots)")
    serve.add_argument("--max-lora-rank", type=int, default=64, help="the largest LoRA rank the trainer sends")
    serve.add_argument(
        "--no-lora",
        action="store_true",
        help="no adapter slots: for full-weight training, and on CPU, where a LoRA policy is sent merged "
        "(vllm_sync_mode 'auto') and the slots only slow the engine's sampling",
    )
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    serve.add_argument("--log", default=None, help="the server's log file (default: a temporary file)")
    serve.add_argument("--dry-run", action="store_true", help="print the server command and exit")
    serve.set_defaults(handler=_serve, vllm_args=[])  # flags after `--` go to vLLM itself (cli.main splits them)
