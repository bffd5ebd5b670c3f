"""One trainer configuration, run in its own process: either from scratch (a checkpoint every step) or resumed from a
checkpoint. Prints "RESULT {...}": the per-step metrics it logged.

python tests/scripts/resume_run.py KIND OUTPUT_DIR --max_steps 4 [--resume CHECKPOINT_DIR]

KIND: grpo_lora_engine (LoRA, colocated vLLM engine, 2 mini-batches per rollout), grpo_full_masters (full
fine-tuning, fp32 master weights), ppo_separate (LoRA policy, separate full critic, adaptive KL), ppo_shared_base
(critic adapter on the policy's base), ppo_full (full policy, frozen reference copy), dpo_offline (LoRA),
dpo_online (LoRA, colocated engine), grpo_dynamic_sampling (LoRA, colocated engine, dynamic sampling: half the prompts
score groups without signal, so steps over-sample, carry groups over and run further rounds).
"""

import argparse
import hashlib
import json

from peft import LoraConfig

from trlx_scale import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from trlx_scale.process_exit import run_then_exit
from trlx_scale.tasks import addition_dataset, addition_preference_dataset, default_model_path, exact_match_reward

LORA = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
COMMON = dict(
    logging_steps=1, save_strategy="steps", save_steps=1, report_to="none", bf16=False, seed=13, disable_tqdm=True
)
ENGINE = dict(use_vllm=True, vllm_mode="colocate", vllm_dtype="float32", vllm_cpu_kvcache_space=0.5)


def alternating_reward(completions, **kwargs):
    """Varies within each group, so every step has a gradient even while exact match is flat."""
    return [float(index % 2) for index in range(len(completions))]


REWARDS = [exact_match_reward, alternating_reward]


def half_flat_reward(completion_ids, answer, **kwargs):
    """No signal for even answers (a constant); for odd ones a function of the completion's tokens."""
    return [
        0.5
        if int(a) % 2 == 0
        else int.from_bytes(hashlib.blake2b(str(ids).encode(), digest_size=2).digest(), "big") / 65535
        for ids, a in zip(completion_ids, answer, strict=True)
    ]


def build(kind: str, output_dir: str, max_steps: int):
    rollout = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=5, learning_rate=1e-3)
    train = addition_dataset("train", size=64)
    if kind == "grpo_dynamic_sampling":
        sampling = dict(dynamic_sampling=True, dynamic_sampling_max_oversample=3.0, per_device_train_batch_size=8)
        args = GRPOConfig(output_dir=output_dir, max_steps=max_steps, **COMMON, **{**rollout, **ENGINE, **sampling})
        return GRPOTrainer(
            model=default_model_path(), reward_funcs=half_flat_reward, args=args, train_dataset=train, peft_config=LORA
        )
    if kind.startswith("grpo"):
        if kind == "grpo_lora_engine":
            extra, peft = dict(**ENGINE, steps_per_generation=2), LORA
        else:
            extra, peft = dict(fp32_master_weights=True, learning_rate=1e-4), None
        args = GRPOConfig(output_dir=output_dir, max_steps=max_steps, **COMMON, **{**rollout, **extra})
        return GRPOTrainer(
            model=default_model_path(), reward_funcs=REWARDS, args=args, train_dataset=train, peft_config=peft
        )
    if kind.startswith("ppo"):
        extra = {"ppo_shared_base": dict(critic_mode="shared_base"), "ppo_full": dict(learning_rate=1e-4)}.get(
            kind, {}
        )
        args = PPOConfig(
            output_dir=output_dir,
            max_steps=max_steps,
            critic_learning_rate=1e-3,
            kl_coef=0.5,
            kl_target=0.01,
            kl_horizon=100,
            **COMMON,
            **{**rollout, **extra},
        )
        peft = None if kind == "ppo_full" else LORA
        return PPOTrainer(
            model=default_model_path(), reward_funcs=REWARDS, args=args, train_dataset=train, peft_config=peft
        )
    if kind == "dpo_offline":
        args = DPOConfig(
            output_dir=output_dir,
            max_steps=max_steps,
            per_device_train_batch_size=8,
            max_length=64,
            learning_rate=1e-3,
            **COMMON,
        )
        return DPOTrainer(
            model=default_model_path(), args=args, train_dataset=addition_preference_dataset(size=64), peft_config=LORA
        )
    if kind == "dpo_online":
        args = DPOConfig(
            output_dir=output_dir,
            max_steps=max_steps,
            per_device_train_batch_size=4,
            online=True,
            online_num_generations=4,
            online_max_completion_length=5,
            learning_rate=1e-3,
            **COMMON,
            **{k: ENGINE[k] for k in ("vllm_dtype", "vllm_cpu_kvcache_space")},
        )
        return DPOTrainer(
            model=default_model_path(), args=args, train_dataset=train, reward_funcs=REWARDS, peft_config=LORA
        )
    raise ValueError(f"unknown kind {kind!r}")


def run(kind: str, output_dir: str, max_steps: int = 4, resume: str | None = None) -> dict:
    """Train (or resume) ``kind`` and return its logged metrics per step, timings left out."""
    trainer = build(kind, output_dir, max_steps)
    trainer.train(resume_from_checkpoint=resume)
    return {
        str(entry["step"]): {
            k: v
            for k, v in entry.items()
            if isinstance(v, (int, float))
            and not k.startswith(
                ("time/", "throughput/", "perf/", "memory/", "step_time", "train_", "sync/seconds", "generation/")
            )
        }
        for entry in trainer.state.log_history
        if "loss" in entry
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind")
    parser.add_argument("output_dir")
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--resume", default=None)
    cli = parser.parse_args()
    print("RESULT " + json.dumps(run(cli.kind, cli.output_dir, cli.max_steps, cli.resume)), flush=True)


if __name__ == "__main__":
    run_then_exit(main)
