# Copyright trlx_scale contributors. Apache-2.0.
"""GRPO with a colocated vLLM engine, on the embedded default model and addition task or on any Hub model/dataset.

    accelerate launch examples/grpo.py                      # embedded model + toy task, vLLM colocate, LoRA
    python examples/grpo.py --max_steps 20                  # same, plain python
    accelerate launch --multi_gpu --num_processes 2 examples/grpo.py   # 2 data-parallel processes (also on CPU)
    accelerate launch examples/grpo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --dataset_name <hub dataset with "prompt" and "answer" columns> --push_to_hub --hub_model_id me/my-run

Every field of `trlx_scale.GRPOConfig`, `trl.ModelConfig` and the script arguments below is a CLI flag
(`--help` lists them); `--config recipe.yaml` reads them from a file. Accuracy is exact match of the greedy
completion against the dataset's answer column, on held-out prompts, before and after training.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

# Allow `python examples/grpo.py` from a source checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config  # noqa: E402
from trl.models import unwrap_model_for_generation  # noqa: E402

from trlx_scale import GRPOConfig, GRPOTrainer, addition_dataset, default_model_path, exact_match_reward  # noqa: E402
from trlx_scale.evaluation import exact_match_accuracy  # noqa: E402
from trlx_scale.reporting import RunSummary  # noqa: E402


@dataclass
class GRPOScriptArguments(ScriptArguments):
    """Dataset and evaluation options of this example (TRL's `ScriptArguments` plus the fields below)."""

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


# Optimizer fields an --optim_preset fills; the example's own values for them step aside when a preset is chosen.
# Tuned on the embedded task (docs/quickstart.md): at 1e-3 LoRA gains less and at 2e-3 it collapses.
EXAMPLE_OPTIMIZER_DEFAULTS = dict(learning_rate=5e-4, lr_scheduler_type="constant_with_warmup", warmup_steps=5)


def example_defaults(argv: list[str]) -> dict:
    """Defaults of this example: the embedded model and task, vLLM colocated, LoRA, a few minutes on 2 CPU cores."""
    defaults = dict(
        model_name_or_path=default_model_path(),
        use_peft=True,
        # Tuned on the embedded task (docs/quickstart.md): rank 64 learns clearly faster than 16 there.
        lora_r=64,
        lora_alpha=128,
        lora_dropout=0.0,
        lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        use_vllm=True,
        vllm_mode="colocate",
        vllm_dtype="trainer",
        output_dir="outputs/grpo-addition",
        max_steps=200,
        per_device_train_batch_size=128,  # 16 prompts x 8 completions per process and step
        num_generations=8,
        max_completion_length=6,
        temperature=1.0,
        beta=0.0,
        # Each prompt's 8 completions reuse one pass over the prompt in the log-prob and loss passes (exact; off with
        # the reason logged where it cannot apply). docs/shared_prefix.md.
        shared_prefix="auto",
        logging_steps=20,
        save_strategy="no",
        report_to="none",
        seed=42,
    )
    if not any(arg == "--optim_preset" or arg.startswith("--optim_preset=") for arg in argv):
        defaults.update(EXAMPLE_OPTIMIZER_DEFAULTS)
    if not torch.cuda.is_available():
        # CPU: fp32 compute, and under a multi-process launcher the gloo process group (DeepSpeed ZeRO-3 included).
        defaults["bf16"] = False
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


def load_data(script_args: GRPOScriptArguments, seed: int):
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


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig))
    parser.set_defaults_with_config(**example_defaults(argv))
    script_args, training_args, model_args = parser.parse_args_and_config(argv)

    train_dataset, held_out = load_data(script_args, training_args.seed)
    answer_column = script_args.answer_column

    def reward_exact_match(completions, **columns):
        return exact_match_reward(completions, answer=columns[answer_column])

    model_init_kwargs = dict(training_args.model_init_kwargs or {})
    if model_args.dtype is not None:
        model_init_kwargs.setdefault("dtype", model_args.dtype)
    training_args.model_init_kwargs = model_init_kwargs or None

    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_exact_match,
        args=training_args,
        train_dataset=train_dataset,
        peft_config=get_peft_config(model_args),
    )

    def accuracy() -> float | None:
        if not script_args.eval_size:
            return None
        # Under ZeRO-3 the weights are partitioned: every process gathers them for generation (a collective).
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
            return exact_match_accuracy(
                model,
                trainer.processing_class,
                held_out["prompt"],
                held_out[answer_column],
                max_new_tokens=script_args.eval_max_new_tokens,
            )

    summary = RunSummary(model=model_args.model_name_or_path, world_size=trainer.accelerator.num_processes)
    summary.accuracy_before = accuracy()
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume_argument(training_args.resume_from_checkpoint))
    summary.train_seconds = time.perf_counter() - start
    summary.accuracy_after = accuracy()
    summary.read_log_history(trainer.state.log_history, trainer.state.global_step)

    dataset_label = script_args.dataset_name or "trlx_scale/addition"
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        trainer.create_model_card(dataset_name=dataset_label)  # README.md beside the weights, also offline
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_label)
    if trainer.accelerator.is_main_process:
        summary.write_json(os.path.join(training_args.output_dir, "run_summary.json"))
        print(summary.render(), flush=True)
    return summary.as_dict()


if __name__ == "__main__":
    main()
