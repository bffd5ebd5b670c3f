# Copyright trlx_scale contributors. Apache-2.0.
"""Asynchronous GRPO: generation on a vLLM server overlapping training, on the embedded model and task or any Hub
model/dataset.

    trlx-scale async_grpo                                      # embedded model + task; starts its own server
    trlx-scale serve Qwen/Qwen3-0.6B --devices 4,5,6,7 &       # a server on GPUs of its own, then:
    trlx-scale async_grpo --model_name_or_path Qwen/Qwen3-0.6B --vllm_server_base_url http://127.0.0.1:8000 \\
        --max_staleness 2 --dataset_name <hub dataset with "prompt" and "answer" columns> --accelerate_config fsdp2

Every field of `trlx_scale.AsyncGRPOConfig`, `trl.ModelConfig` and the task arguments is a CLI flag (`--help` lists
them). The process layout, choosing `max_staleness` and reading the `async/*` metrics: docs/async.md.
"""

from __future__ import annotations

import os

# On a CPU-only machine the trainer shares its cores with the vLLM server: OpenMP threads that spin between parallel
# regions (OpenMP's default) take them from the other process. Read when torch loads OpenMP, so set before any import
# of torch. Measured on 2 cores with a 1 s reward: 47 samples/s spinning, 153 passive (docs/benchmarks.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from trlx_scale import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trlx_scale.process_exit import run_then_exit
from trlx_scale.tasks.example_runtime import ROLLOUT_EXAMPLE_DEFAULTS, Example, run_example  # noqa: E402


def async_grpo_defaults(parsed) -> dict:
    """GRPO's example defaults, generating on a server, with no KL term and one step of overlap: on this task's
    short, even completions 1, 2 and 4 are as fast as each other within the noise on a 2-core machine with a 1 s
    reward (1.37x, 1.40x, 1.43x the synchronous trainer, six repeats), and 1 trains on the freshest samples (it
    loses the least held-out accuracy against sync: docs/benchmarks.md)."""
    return {
        **ROLLOUT_EXAMPLE_DEFAULTS,
        "output_dir": "outputs/async-grpo-addition",
        "beta": 0.0,
        "vllm_mode": "server",
        "max_staleness": 1,
    }


EXAMPLE = Example(
    trainer_cls=AsyncGRPOTrainer, config_cls=AsyncGRPOConfig, defaults=async_grpo_defaults, takes_tools=True
)


def main(argv: list[str] | None = None) -> dict:
    return run_example(EXAMPLE, argv)


if __name__ == "__main__":
    run_then_exit(main)
