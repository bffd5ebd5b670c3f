"""What the examples share: task arguments and data, CPU launch defaults, held-out accuracy, and the end of a run
(save, model card, Hub push, summary). Kept in the package so that examples/grpo.py, ppo.py and dpo.py stay short.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from datasets import load_dataset
from trl import ScriptArguments
from trl.models import unwrap_model_for_generation

from .addition import addition_dataset
from .evaluation import exact_match_accuracy
from .run_summary import RunSummary


@dataclass
class TaskScriptArguments(ScriptArguments):
    """Dataset and evaluation options of the RL examples (TRL's `ScriptArguments` plus the fields below)."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset (or local path) with a 'prompt' column and an answer column. Unset: the embedded "
            "two-digit addition task."
        },
    )
    answer_column: str = field(
        default="answer",
        metadata={"help": "Column holding the expected answer; the reward is exact match against it."},
    )
    train_size: int | None = field(
        default=None, metadata={"help": "Use only the first N training prompts (all when unset)."}
    )
    eval_size: int = field(
        default=600, metadata={"help": "Held-out prompts scored before and after training (0 disables it)."}
    )
    eval_max_new_tokens: int = field(
        default=8, metadata={"help": "Tokens generated per held-out prompt when measuring accuracy."}
    )


def cpu_launch_defaults() -> dict:
    """On CPU: fp32 compute, and under a multi-process launcher the gloo process group (DeepSpeed ZeRO-3 included)."""
    if torch.cuda.is_available():
        return {}
    defaults = {"bf16": False}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        defaults["ddp_backend"] = "gloo"  # the process group that runs on CPU (DeepSpeed included)
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
            # Without use_cpu, Accelerate sees no accelerator and treats the processes as independent (its
            # gathers become no-ops); with it, they form one gloo process group (DistributedType.MULTI_CPU).
            defaults["use_cpu"] = True
    return defaults


def resume_argument(value: str | None) -> str | bool | None:
    """--resume_from_checkpoint: a checkpoint path, 'true'/'latest' for the newest one in output_dir, or off."""
    if value is None or value.lower() in ("", "false", "none"):
        return None
    if value.lower() in ("true", "latest"):
        return True
    return value


def load_prompt_task(script_args: TaskScriptArguments, seed: int):
    """(train dataset, held-out dataset) with 'prompt' and the answer column."""
    if script_args.dataset_name is None:
        train = addition_dataset("train", size=script_args.train_size)
        held_out = addition_dataset("held_out", size=script_args.eval_size or None)
        return train, held_out
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    train = dataset[script_args.dataset_train_split]
    for column in ("prompt", script_args.answer_column):
        if column not in train.column_names:
            raise ValueError(
                f"Dataset {script_args.dataset_name!r} has no {column!r} column (columns: {train.column_names}). "
                "Rename its columns, or pass --answer_column for the answer."
            )
    if script_args.dataset_test_split in dataset:
        held_out = dataset[script_args.dataset_test_split]
    else:
        split = train.train_test_split(test_size=max(script_args.eval_size, 1), seed=seed)
        train, held_out = split["train"], split["test"]
    if script_args.train_size is not None:
        train = train.select(range(min(script_args.train_size, len(train))))
    if script_args.eval_size:
        held_out = held_out.select(range(min(script_args.eval_size, len(held_out))))
    return train, held_out


def held_out_accuracy(trainer, held_out, answer_column: str, max_new_tokens: int) -> float | None:
    """Exact-match accuracy of greedy completions on ``held_out`` (None when there is no held-out set)."""
    if held_out is None or len(held_out) == 0:
        return None
    # Under ZeRO-3 the weights are partitioned: every process gathers them for generation (a collective).
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
        return exact_match_accuracy(
            model, trainer.processing_class, held_out["prompt"], held_out[answer_column], max_new_tokens=max_new_tokens
        )


def finish_run(trainer, summary: RunSummary, output_dir: str, dataset_label: str, push_to_hub: bool) -> dict:
    """Save the model with its card, push it when asked, write ``run_summary.json`` atomically and print it."""
    trainer.save_model(output_dir)
    if trainer.accelerator.is_main_process:
        trainer.create_model_card(dataset_name=dataset_label)  # README.md beside the weights, also offline
    if push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_label)
    if trainer.accelerator.is_main_process:
        summary.write_json(os.path.join(output_dir, "run_summary.json"))
        print(summary.render(), flush=True)
    return summary.as_dict()
