# Copyright trlx_scale contributors. Apache-2.0.
"""GRPO with a colocated vLLM engine, on the embedded default model and addition task or on any Hub model/dataset.

    trlx-scale grpo                                  # embedded model + task, LoRA, vLLM colocate
    trlx-scale grpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name <hub dataset with "prompt" and "answer" columns> --push_to_hub --hub_model_id me/my-grpo

Every field of `trlx_scale.GRPOConfig`, `trl.ModelConfig` and the task arguments is a CLI flag (`--help` lists
them; `--config file.yaml` sets them too). Accuracy is exact match of the greedy completion on held-out prompts,
before and after training. What all examples share is in `trlx_scale.tasks.example_runtime`.
"""

from __future__ import annotations

from trlx_scale import GRPOConfig, GRPOTrainer
from trlx_scale.process_exit import run_then_exit
from trlx_scale.tasks.example_runtime import ROLLOUT_EXAMPLE_DEFAULTS, Example, run_example


def grpo_defaults(parsed) -> dict:
    """This example's defaults, on top of the shared ones: no KL term (beta 0)."""
    return {**ROLLOUT_EXAMPLE_DEFAULTS, "output_dir": "outputs/grpo-addition", "beta": 0.0}


EXAMPLE = Example(trainer_cls=GRPOTrainer, config_cls=GRPOConfig, defaults=grpo_defaults, takes_tools=True)


def main(argv: list[str] | None = None) -> dict:
    return run_example(EXAMPLE, argv)


if __name__ == "__main__":
    run_then_exit(main)
