# Copyright trlx_scale contributors. Apache-2.0.
"""DPO on the embedded default model and addition task (offline preference pairs, or online with the colocated
vLLM engine), or on any Hub model/preference dataset.

    accelerate launch examples/dpo.py                       # offline: correct answer chosen over a wrong one, LoRA
    accelerate launch examples/dpo.py --online              # online: the policy samples, exact match ranks, vLLM
    python examples/dpo.py --vllm_ref_log_probs             # reference log-probs precomputed by vLLM
    accelerate launch examples/dpo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --dataset_name trl-lib/ultrafeedback_binarized --eval_size 0 --push_to_hub --hub_model_id me/my-dpo

Every field of `trlx_scale.DPOConfig`, `trl.ModelConfig` and the script arguments below is a CLI flag (`--help`
lists them). On the embedded task, accuracy is exact match of the greedy completion on held-out prompts, before and
after training.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

# Allow `python examples/dpo.py` from a source checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datasets import load_dataset  # noqa: E402
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config  # noqa: E402

from trlx_scale import (  # noqa: E402
    DPOConfig,
    DPOTrainer,
    addition_dataset,
    addition_preference_dataset,
    default_model_path,
    exact_match_reward,
)
from trlx_scale.tasks.example_runtime import cpu_launch_defaults, finish_run, held_out_accuracy, resume_argument  # noqa: E402
from trlx_scale.tasks.run_summary import RunSummary  # noqa: E402


@dataclass
class DPOScriptArguments(ScriptArguments):
    """Dataset and evaluation options of this example (TRL's `ScriptArguments` plus the fields below)."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub preference dataset (prompt/chosen/rejected; prompt-only plus answer column with --online). "
            "Unset: the embedded addition task."
        },
    )
    answer_column: str = field(
        default="answer",
        metadata={"help": "With --online on a Hub dataset: the column exact match is scored against."},
    )
    train_size: int | None = field(default=None, metadata={"help": "Use only the first N training examples."})
    eval_size: int = field(
        default=600,
        metadata={"help": "Held-out addition prompts scored before and after training (0 disables it)."},
    )
    eval_max_new_tokens: int = field(
        default=8, metadata={"help": "Tokens generated per held-out prompt when measuring accuracy."}
    )


def example_defaults(argv: list[str]) -> dict:
    """Defaults of this example: the embedded model and task, LoRA, a few minutes on 2 CPU cores."""
    online = any(arg == "--online" or arg.startswith("--online=") for arg in argv)
    defaults = dict(
        model_name_or_path=default_model_path(),
        use_peft=True,
        lora_r=64,
        lora_alpha=128,
        lora_dropout=0.0,
        lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        output_dir="outputs/dpo-addition-online" if online else "outputs/dpo-addition",
        max_steps=EXAMPLE_STEPS["online" if online else "offline"],
        per_device_train_batch_size=32,
        learning_rate=EXAMPLE_LEARNING_RATE["online" if online else "offline"],
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=5,
        beta=0.1,
        max_length=64,
        online_num_generations=8,
        online_max_completion_length=6,
        vllm_dtype="trainer",
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        seed=42,
    )
    defaults.update(cpu_launch_defaults())
    return defaults


# Tuned on the embedded task (docs/dpo.md).
EXAMPLE_STEPS = {"offline": 100, "online": 100}
EXAMPLE_LEARNING_RATE = {"offline": 1e-4, "online": 5e-4}


def load_data(script_args: DPOScriptArguments, online: bool):
    """(train dataset, held-out prompt dataset or None)."""
    if script_args.dataset_name is None:
        size = script_args.train_size
        train = addition_dataset("train", size=size) if online else addition_preference_dataset("train", size=size)
        held_out = addition_dataset("held_out", size=script_args.eval_size) if script_args.eval_size else None
        return train, held_out
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    train = dataset[script_args.dataset_train_split]
    needed = ("prompt", script_args.answer_column) if online else ("chosen", "rejected")
    missing = [column for column in needed if column not in train.column_names]
    if missing:
        raise ValueError(
            f"Dataset {script_args.dataset_name!r} lacks {missing} (columns: {train.column_names}); "
            + ("--online needs prompts and an answer column (--answer_column)." if online else "DPO needs pairs.")
        )
    if script_args.train_size is not None:
        train = train.select(range(min(script_args.train_size, len(train))))
    return train, None  # held-out accuracy is the embedded task's metric


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = TrlParser((DPOScriptArguments, DPOConfig, ModelConfig))
    parser.set_defaults_with_config(**example_defaults(argv))
    script_args, training_args, model_args = parser.parse_args_and_config(argv)

    train_dataset, held_out = load_data(script_args, training_args.online)
    answer_column = script_args.answer_column

    def reward_exact_match(completions, **columns):
        return exact_match_reward(completions, answer=columns[answer_column])

    model_init_kwargs = dict(training_args.model_init_kwargs or {})
    if model_args.dtype is not None:
        model_init_kwargs.setdefault("dtype", model_args.dtype)
    training_args.model_init_kwargs = model_init_kwargs or None

    trainer = DPOTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        peft_config=get_peft_config(model_args),
        reward_funcs=reward_exact_match if training_args.online else None,
    )

    def accuracy() -> float | None:
        return held_out_accuracy(trainer, held_out, "answer", script_args.eval_max_new_tokens)

    summary = RunSummary(model=model_args.model_name_or_path, world_size=trainer.accelerator.num_processes)
    summary.accuracy_before = accuracy()
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume_argument(training_args.resume_from_checkpoint))
    summary.train_seconds = time.perf_counter() - start
    summary.accuracy_after = accuracy()
    summary.read_log_history(trainer.state.log_history, trainer.state.global_step, reward_key="online/reward_mean")
    dataset_label = script_args.dataset_name or "trlx_scale/addition"
    return finish_run(trainer, summary, training_args.output_dir, dataset_label, training_args.push_to_hub)


if __name__ == "__main__":
    main()
