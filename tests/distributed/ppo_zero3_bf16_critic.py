"""PPO's separate critic under DeepSpeed ZeRO-3 with bf16 on (the precision of configs/accelerate/zero3.yaml), with
fp32 master weights (an optimizer preset), 2 processes:

accelerate launch --config_file ZERO3_BF16.yaml tests/distributed/ppo_zero3_bf16_critic.py OUTPUT_DIR

The critic's backbone comes in bf16 and its value head in fp32, while ZeRO-3's flat partitions take one dtype: the
critic's engine must be built (it used to fail in DeepSpeed's partitioning with an AssertionError). Builds the trainer
(its critic engine) and writes rank<R>.json with the critic's parameter dtypes and its fp32 master partition's. The
policy's own engine is built at train() and is not reached here: on CPU, transformers refuses bf16=True without
use_cpu, which DeepSpeed refuses in turn, so the policy cannot train bf16 on this machine.
"""

import json
import os
import sys

from report import leave_group  # tests/distributed/report.py (the script's folder)

from trlx_scale import PPOConfig, PPOTrainer
from trlx_scale.tasks import addition_dataset, default_model_path, exact_match_reward


def main(output_dir: str) -> None:
    args = PPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=5,
        max_steps=1,
        optim_preset="ppo_policy",
        fp32_master_weights=True,
        bf16=False,  # TrainingArguments refuses bf16 on CPU without use_cpu; the DeepSpeed JSON turns bf16 on
        report_to="none",
        disable_tqdm=True,
        ddp_backend="gloo",
        gradient_checkpointing=False,
    )
    trainer = PPOTrainer(
        model=default_model_path(),
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=addition_dataset("train", size=16),
    )
    critic = trainer.critic_training
    report = {
        "backend": critic.backend,
        "param_dtypes": sorted({str(p.dtype) for p in critic.critic.parameters()}),
        "master_dtypes": sorted({str(t.dtype) for t in critic.module.optimizer.fp32_partitioned_groups_flat}),
        "partitioned": all(hasattr(p, "ds_id") for p in critic.critic.parameters()),
    }
    with open(os.path.join(output_dir, f"rank{trainer.accelerator.process_index}.json"), "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    leave_group()  # after main(): the trainer is unreferenced, so its gloo work is done before the group goes
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
