# Copyright trlx_scale contributors. Apache-2.0.
"""DPO on the embedded default model and addition task (offline preference pairs, or online with the colocated
vLLM engine), or on any Hub model/preference dataset.

    trlx-scale dpo                       # offline: correct answer chosen over a wrong one, LoRA
    trlx-scale dpo --online              # online: the policy samples, exact match ranks, vLLM
    trlx-scale dpo --vllm_ref_log_probs             # reference log-probs precomputed by vLLM
    trlx-scale dpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name trl-lib/ultrafeedback_binarized --eval_size 0 --push_to_hub --hub_model_id me/my-dpo

Every field of `trlx_scale.DPOConfig`, `trl.ModelConfig` and the script arguments below is a CLI flag (`--help`
lists them). On the embedded task, accuracy is exact match of the greedy completion on held-out prompts, before and
after training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trlx_scale import DPOConfig, DPOTrainer
from trlx_scale.process_exit import run_then_exit
from trlx_scale.tasks import addition_dataset, addition_preference_dataset
from trlx_scale.tasks.example_runtime import (
    Example,
    TaskData,
    TaskScriptArguments,
    eval_strategy,
    run_example,
    trains_embedded_task,
)
from trlx_scale.tasks.user_dataset import load_user_dataset, split_or_none


@dataclass
class DPOScriptArguments(TaskScriptArguments):
    """The task arguments, with DPO's meaning of the dataset and answer columns."""

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


# Tuned on the embedded task (docs/dpo.md).
EXAMPLE_STEPS = {"offline": 100, "online": 100}
EXAMPLE_LEARNING_RATE = {"offline": 1e-4, "online": 5e-4}


def dpo_defaults(parsed) -> dict:
    """Offline or online (`--online`, on the command line or in a --config file) get their own tuned values."""
    mode = "online" if parsed is not None and parsed.online else "offline"
    return dict(
        output_dir="outputs/dpo-addition-online" if mode == "online" else "outputs/dpo-addition",
        max_steps=EXAMPLE_STEPS[mode],
        per_device_train_batch_size=32,
        learning_rate=EXAMPLE_LEARNING_RATE[mode],
        beta=0.1,
        max_length=64,
        online_num_generations=8,
        online_max_completion_length=6,
        logging_steps=10,
    )


def load_data(script_args: DPOScriptArguments, config: DPOConfig, dataset_args=None) -> TaskData:
    """The embedded addition task (preference pairs, or prompts with --online) or a user's dataset, every training row
    trained on; under --eval_strategy the trainer evaluates the test split (the embedded task: held-out pairs)."""
    online = config.online
    evaluates = eval_strategy(config) != "no"
    if trains_embedded_task(script_args, dataset_args):
        size = script_args.train_size
        train = addition_dataset("train", size=size) if online else addition_preference_dataset("train", size=size)
        held_out = addition_dataset("held_out", size=script_args.eval_size) if script_args.eval_size else None
        evaluation = None
        if evaluates:
            size = script_args.eval_size or None
            evaluation = (
                addition_dataset("held_out", size) if online else addition_preference_dataset("held_out", size)
            )
        return TaskData(train, held_out, evaluation)
    dataset = load_user_dataset(script_args, dataset_args)
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
    evaluation = split_or_none(dataset, script_args.dataset_test_split) if evaluates else None
    if evaluates and evaluation is None:
        raise ValueError(
            f"--eval_strategy {eval_strategy(config)} needs pairs to evaluate: dataset {script_args.dataset_name!r} "
            f"has no {script_args.dataset_test_split!r} split; pass --dataset_test_split."
        )
    return TaskData(train, None, evaluation)  # held-out exact-match accuracy is the embedded task's metric


def online_rewards(rewards: list) -> list:
    """Online DPO ranks its samples with reward functions (a reward model is GRPO's and PPO's)."""
    models = [reward for reward in rewards if not callable(reward)]
    if models:
        raise ValueError(f"--reward_model_name_or_path {models[0]}: online DPO ranks with --reward_funcs only.")
    return rewards


EXAMPLE = Example(
    trainer_cls=DPOTrainer,
    config_cls=DPOConfig,
    defaults=dpo_defaults,
    script_args_cls=DPOScriptArguments,
    load_data=load_data,
    trainer_kwargs=lambda config, rewards: {"reward_funcs": online_rewards(rewards) if config.online else None},
    reward_key="online/reward_mean",
)


def main(argv: list[str] | None = None) -> dict:
    return run_example(EXAMPLE, argv)


if __name__ == "__main__":
    run_then_exit(main)
