"""A user's own GRPO script without use_cpu, launched on 2 CPU processes with configs/accelerate/cpu_ddp.yaml:
the trainer must refuse to start (each process would otherwise train alone). Prints "REFUSED <message>" and exits 3
on a refusal, exits 0 if the trainer was built.

accelerate launch --config_file configs/accelerate/cpu_ddp.yaml tests/scripts/launch_without_use_cpu.py OUTPUT_DIR
"""

import sys

from trlx_scale import GRPOConfig, GRPOTrainer
from trlx_scale.tasks import addition_dataset, default_model_path, exact_match_reward

if __name__ == "__main__":
    config = GRPOConfig(output_dir=sys.argv[1], bf16=False, report_to="none", per_device_train_batch_size=4,
                        num_generations=4, max_steps=1)  # fmt: skip
    try:
        GRPOTrainer(
            model=default_model_path(),
            reward_funcs=exact_match_reward,
            args=config,
            train_dataset=addition_dataset("train", size=16),
        )
    except ValueError as error:
        print(f"REFUSED {error}", flush=True)
        sys.exit(3)
