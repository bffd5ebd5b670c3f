"""Two gloo processes train GRPO with dynamic sampling on their colocated vLLM engines; every group rank 1 scores is
zero-variance (its reward is constant), rank 0's carry signal. Each rank writes, per rollout, the answers of the rows
it trained and the rewards' spread per trained group.

torchrun --nproc_per_node 2 tests/distributed/dynamic_sampling_uneven.py OUTPUT_DIR
"""

import hashlib
import json
import os
import sys

import torch.distributed as dist

from trlx_scale import GRPOConfig, GRPOTrainer
from trlx_scale.tasks import addition_dataset, default_model_path


def rank_dependent_reward(completions, completion_ids, **kwargs):
    """Constant on rank 1 (every group it scores has no signal); on rank 0 a function of the completion's tokens."""
    if int(os.environ["RANK"]) == 1:
        return [0.5 for _ in completions]
    return [
        int.from_bytes(hashlib.blake2b(str(ids).encode(), digest_size=2).digest(), "big") / 65535
        for ids in completion_ids
    ]


class RecordingGRPOTrainer(GRPOTrainer):
    def _finish_rollout(self, batch):
        rewards = batch.rewards_per_func[:, 0].view(-1, self.num_generations)
        start = self.accelerator.process_index * len(batch.rows)
        mine = batch.rewards_per_func[start : start + len(batch.rows), 0].view(-1, self.num_generations)
        self.recorded.append(
            {
                "rows": len(batch.rows),
                "group_std": mine.std(dim=1).tolist(),
                "all_group_std": rewards.std(dim=1).tolist(),
            }
        )
        return super()._finish_rollout(batch)


def main(output_dir: str) -> None:
    rank = int(os.environ["RANK"])
    args = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",
        disable_tqdm=True,
        use_vllm=True,
        vllm_mode="colocate",
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=4,
        seed=5,
    )
    trainer = RecordingGRPOTrainer(
        model=default_model_path(),
        reward_funcs=rank_dependent_reward,
        args=args,
        train_dataset=addition_dataset("train", size=64),
    )
    trainer.recorded = []
    trainer.train()
    logs = [
        {k: v for k, v in entry.items() if k.startswith("batch/")}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as handle:
        json.dump({"steps": trainer.state.global_step, "rollouts": trainer.recorded, "logs": logs}, handle)
    # Both ranks are done; leave without tearing down (see tests/distributed/uneven_tool_turns.py).
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
