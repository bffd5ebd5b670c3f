"""PPO under DeepSpeed ZeRO-3 (2 processes): how much of each role one rank holds, and a resume of the critic.

accelerate launch --config_file configs/accelerate/cpu_zero3.yaml tests/distributed/ppo_zero3_partitions.py \
    KIND OUTPUT_DIR

KIND: "separate" (LoRA policy, separate full critic), "full" (full policy: a frozen reference copy, separate full
critic), "shared_base" (critic adapter and value head on the policy's LoRA base). Trains 2 steps with a checkpoint
after step 1, counts on each rank the elements of the critic's parameters, its fp32 master partition and its Adam
states held locally against their full sizes (and the reference model's), then resumes a second trainer from
checkpoint-1 and trains step 2 again. Each rank writes rank<R>.json.
"""

import json
import os
import sys

import torch
from peft import LoraConfig
from report import leave_group  # tests/distributed/report.py (the script's folder)

from trlx_scale import PPOConfig, PPOTrainer
from trlx_scale.tasks import addition_dataset, default_model_path, exact_match_reward

LORA = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")


def alternating_reward(completions, **kwargs):
    """Varies within each group, so every step has a gradient."""
    return [float(index % 2) for index in range(len(completions))]


def build(kind: str, output_dir: str) -> PPOTrainer:
    args = PPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=5,
        max_steps=2,
        learning_rate=1e-4,
        critic_learning_rate=1e-3,
        critic_mode="shared_base" if kind == "shared_base" else "separate",
        logging_steps=1,
        save_strategy="steps",
        save_steps=1,
        report_to="none",
        bf16=False,
        seed=13,
        disable_tqdm=True,
        ddp_backend="gloo",
        gradient_checkpointing=False,
    )
    return PPOTrainer(
        model=default_model_path(),
        reward_funcs=[exact_match_reward, alternating_reward],
        args=args,
        train_dataset=addition_dataset("train", size=64),
        peft_config=None if kind == "full" else LORA,
    )


def _held(params) -> dict:
    """Elements of ZeRO-3 parameters: held on this rank (its partition) and in full."""
    params = list(params)
    assert params and all(hasattr(p, "ds_id") for p in params), "not ZeRO-3 partitioned"
    return {"local": sum(p.ds_tensor.numel() for p in params), "full": sum(p.ds_numel for p in params)}


def _optimizer_held(zero_optimizer) -> dict:
    """The fp32 master partition and Adam's two moments that this rank's ZeRO-3 optimizer holds."""
    masters = zero_optimizer.fp32_partitioned_groups_flat
    moments = 0
    for flat in masters:
        state = zero_optimizer.optimizer.state[flat]
        moments += state["exp_avg"].numel() + state["exp_avg_sq"].numel()
    return {"masters": sum(m.numel() for m in masters), "moments": moments}


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main(kind: str, output_dir: str) -> None:
    trainer = build(kind, os.path.join(output_dir, "run"))
    trainer.train()
    report = {"losses": losses(trainer), "world_size": trainer.accelerator.num_processes}
    # What the trainer logs each role holds (planning/held_memory.py), at its last log.
    last = [entry for entry in trainer.state.log_history if "memory/held/policy_gib" in entry][-1]
    report["held_gib"] = {key.split("/")[-1]: value for key, value in last.items() if key.startswith("memory/held/")}
    if trainer.critic_training is not None:
        report["critic_backend"] = trainer.critic_training.backend
        report["critic"] = _held(trainer.critic.parameters())
        report["critic_optimizer"] = _optimizer_held(trainer.critic_training.module.optimizer)
    else:
        critic_params = trainer.critic.trainable_parameters()
        report["critic"] = _held(critic_params)
        # The critic's group is the last group of the policy's engine optimizer.
        zero_optimizer = trainer.model_wrapped.optimizer
        report["critic_group_lr"] = zero_optimizer.param_groups[-1]["initial_lr"]
        report["policy_group_lr"] = zero_optimizer.param_groups[0]["initial_lr"]
    if trainer.ppo_ref_model is not None:
        report["reference"] = _held(trainer.ppo_ref_model.module.parameters())
    report["policy"] = _held(p for p in trainer.model_wrapped.module.parameters())
    checkpoint = os.path.join(output_dir, "run", "checkpoint-1")
    report["checkpoint_files"] = sorted(os.listdir(checkpoint))
    del trainer

    resumed = build(kind, os.path.join(output_dir, "resumed"))
    resumed.train(resume_from_checkpoint=checkpoint)
    report["resumed_losses"] = losses(resumed)
    rank = resumed.accelerator.process_index
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(report, handle)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    leave_group()  # after main(): the trainers are unreferenced, so their gloo work is done before the group goes
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
