# Copyright trlx_scale contributors. Apache-2.0.
"""PPO (actor-critic, GAE, KL-penalized reward) with a colocated vLLM engine, on the embedded default model and
addition task or on any Hub model/dataset.

    accelerate launch examples/ppo.py                               # LoRA policy, separate critic, vLLM colocated
    accelerate launch examples/ppo.py --critic_mode shared_base     # critic = 2nd LoRA adapter on the policy's base
    accelerate launch examples/ppo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --dataset_name <hub dataset with "prompt" and "answer" columns> --push_to_hub --hub_model_id me/my-ppo

Every field of `trlx_scale.PPOConfig`, `trl.ModelConfig` and the task arguments is a CLI flag (`--help` lists
them). PPO epochs and mini-batches per rollout are `--num_iterations` and `--steps_per_generation`. Accuracy is exact
match of the greedy completion on held-out prompts, before and after training.
"""

from __future__ import annotations

import os
import sys
import time

# Allow `python examples/ppo.py` from a source checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trl import ModelConfig, TrlParser, get_peft_config  # noqa: E402

from trlx_scale import PPOConfig, PPOTrainer  # noqa: E402
from trlx_scale.tasks import default_model_path, exact_match_reward  # noqa: E402
from trlx_scale.tasks.example_runtime import (  # noqa: E402
    TaskScriptArguments,
    cpu_launch_defaults,
    finish_run,
    held_out_accuracy,
    load_prompt_task,
    resume_argument,
)
from trlx_scale.tasks.run_summary import RunSummary  # noqa: E402


def example_defaults() -> dict:
    """Defaults of this example: the embedded model and task, vLLM colocated, LoRA policy, a few minutes on CPU."""
    defaults = dict(
        model_name_or_path=default_model_path(),
        use_peft=True,
        lora_r=64,
        lora_alpha=128,
        lora_dropout=0.0,
        lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        use_vllm=True,
        vllm_mode="colocate",
        vllm_dtype="trainer",
        output_dir="outputs/ppo-addition",
        # One rollout of 128 samples (16 prompts x 8) per mini-batch, 2 PPO epochs over it: 200 steps = 100 rollouts.
        max_steps=EXAMPLE_STEPS,
        per_device_train_batch_size=128,
        steps_per_generation=1,
        num_iterations=2,
        num_generations=8,
        max_completion_length=6,
        temperature=1.0,
        learning_rate=EXAMPLE_LEARNING_RATE,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=5,
        critic_learning_rate=EXAMPLE_CRITIC_LEARNING_RATE,
        kl_coef=0.05,
        shared_prefix="auto",
        logging_steps=20,
        save_strategy="no",
        report_to="none",
        seed=42,
    )
    defaults.update(cpu_launch_defaults())
    return defaults


# Tuned on the embedded task (docs/benchmarks.md): 2 mini-batches of 64 x 2 epochs (50 rollouts) gained +2.0 points,
# 1 mini-batch of 128 x 2 epochs (100 rollouts) +11.3.
EXAMPLE_STEPS = 200
EXAMPLE_LEARNING_RATE = 5e-4
EXAMPLE_CRITIC_LEARNING_RATE = 1e-3


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = TrlParser((TaskScriptArguments, PPOConfig, ModelConfig))
    parser.set_defaults_with_config(**example_defaults())
    script_args, training_args, model_args = parser.parse_args_and_config(argv)

    train_dataset, held_out = load_prompt_task(script_args, training_args.seed)
    answer_column = script_args.answer_column

    def reward_exact_match(completions, **columns):
        return exact_match_reward(completions, answer=columns[answer_column])

    trainer = PPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_exact_match,
        args=training_args,
        train_dataset=train_dataset,
        peft_config=get_peft_config(model_args),
    )

    def accuracy() -> float | None:
        return held_out_accuracy(trainer, held_out, answer_column, script_args.eval_max_new_tokens)

    summary = RunSummary(model=model_args.model_name_or_path, world_size=trainer.accelerator.num_processes)
    summary.accuracy_before = accuracy()
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume_argument(training_args.resume_from_checkpoint))
    summary.train_seconds = time.perf_counter() - start
    summary.accuracy_after = accuracy()
    summary.read_log_history(trainer.state.log_history, trainer.state.global_step)
    dataset_label = script_args.dataset_name or "trlx_scale/addition"
    return finish_run(trainer, summary, training_args.output_dir, dataset_label, training_args.push_to_hub)


if __name__ == "__main__":
    main()
