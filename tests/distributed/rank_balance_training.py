"""Two gloo processes train GRPO (colocated engine, packed rows) on prompts of very different lengths, with
``balance_ranks`` set by the command line; rank 0 writes the logged steps.

The prompts are the addition problems behind 0 or 40 repeats of a filler word, so some groups are 10x longer than
others and the ranks' costs differ: the deal has something to move.

torchrun --nproc_per_node 2 tests/distributed/rank_balance_training.py BALANCE_RANKS LOSS_TYPE REPORT_JSON
"""

import os
import sys

from datasets import Dataset
from report import finish  # tests/distributed/report.py (the script's folder)

from trlx_scale import GRPOConfig, GRPOTrainer
from trlx_scale.tasks import addition_dataset, default_model_path, exact_match_reward


def prompts(size: int = 32) -> Dataset:
    problems = addition_dataset("train", size=size, conversational=False)
    texts = [("so " * (40 if (i * 7) % 3 == 0 else 0)) + row["prompt"] for i, row in enumerate(problems)]
    return Dataset.from_dict({"prompt": texts, "answer": problems["answer"]})


def main(balance_ranks: str, loss_type: str, report_path: str) -> None:
    args = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(report_path), balance_ranks),
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=6,
        max_steps=3,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",
        bf16=False,
        seed=11,
        disable_tqdm=True,
        padding_free=True,
        balance_ranks=balance_ranks,
        loss_type=loss_type,
    )
    trainer = GRPOTrainer(
        model=default_model_path(), reward_funcs=exact_match_reward, args=args, train_dataset=prompts()
    )
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    del trainer
    finish({"steps": steps}, report_path)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
