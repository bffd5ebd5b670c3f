"""Two gloo processes train GRPO; the reward function raises on rank 1 only. Each rank writes the error it got.

torchrun --nproc_per_node 2 tests/distributed/reward_error_ranks.py OUTPUT_DIR
"""

import json
import os
import sys

from report import leave_group  # tests/distributed/report.py (the script's folder)

from trlx_scale import GRPOConfig, GRPOTrainer
from trlx_scale.reliability import RewardFunctionError
from trlx_scale.tasks import addition_dataset, default_model_path


def picky_reward(completions, **kwargs):
    if int(os.environ["RANK"]) == 1:
        raise KeyError("missing answer column")
    return [0.0 for _ in completions]


def main(output_dir: str) -> None:
    args = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=default_model_path(), reward_funcs=picky_reward, args=args, train_dataset=addition_dataset("train", 16)
    )
    rank = trainer.accelerator.process_index
    try:
        trainer.train()
        outcome = {"error": None}
    except RewardFunctionError as error:
        outcome = {"error": str(error), "type": type(error).__name__}
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(outcome, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    leave_group()  # after main(): the trainer is unreferenced, so its gloo work is done before the group goes
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
