"""Two gloo processes exchange rollout rows (``rollout.rank_balance.exchange_rows``) and check what they received.

Each rank builds every rank's synthetic TRL rollout dict (the same seeds everywhere: ranks of different prompt and
completion widths, a bool mask, a token-level importance ratio (1 at the padding) and a one-column value, a global
count, per-row versions), exchanges its own by a
balanced assignment, and compares its new rows sample by sample with the originals: the real tokens and values, the
trimmed widths, the untouched global value. Rank 0 writes the report.

torchrun --nproc_per_node 2 tests/distributed/rank_balance_exchange.py REPORT_JSON
"""

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from report import leave_group  # tests/distributed/report.py (the script's folder)

from trlx_scale.rollout.rank_balance import balanced_rank_assignment, exchange_rows

ROWS = 4


def rollout(rank: int) -> dict:
    """Rank ``rank``'s rows: left-padded prompts, right-padded completions of lengths that differ by rank."""
    generator = torch.Generator().manual_seed(rank)
    prompt_width, completion_width = 5 + rank, 6 + 5 * rank
    prompt_lengths = torch.randint(1, prompt_width + 1, (ROWS,), generator=generator)
    completion_lengths = torch.randint(1, completion_width + 1, (ROWS,), generator=generator)
    prompt_mask = (torch.arange(prompt_width) >= prompt_width - prompt_lengths[:, None]).long()
    completion_mask = (torch.arange(completion_width) < completion_lengths[:, None]).long()
    return {
        "prompt_ids": torch.randint(3, 100, (ROWS, prompt_width), generator=generator) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(3, 100, (ROWS, completion_width), generator=generator) * completion_mask,
        "completion_mask": completion_mask,
        "advantages": torch.randn(ROWS, generator=generator),
        "num_items_in_batch": torch.tensor(123.0),
        "old_per_token_logps": -torch.rand(ROWS, completion_width, generator=generator) * completion_mask,
        # Token level: 1 at the padding, as TRL's exp(0); a sequence-level (one column) value beside it.
        "importance_sampling_ratio": torch.where(
            completion_mask.bool(), torch.rand(ROWS, completion_width, generator=generator), 1.0
        ),
        "sequence_weight": torch.rand(ROWS, 1, generator=generator),
        "tool_mask": completion_mask.bool(),
        "policy_version": torch.full((ROWS,), 7 + rank),
    }


def sample(rows: dict, i: int) -> dict:
    """Row i's real content, independent of the padding."""
    prompt, completion = rows["prompt_mask"][i].bool(), rows["completion_mask"][i].bool()
    return {
        "prompt": rows["prompt_ids"][i][prompt].tolist(),
        "completion": rows["completion_ids"][i][completion].tolist(),
        "logps": rows["old_per_token_logps"][i][completion].tolist(),
        "tool": rows["tool_mask"][i][completion].tolist(),
        "advantage": rows["advantages"][i].item(),
        "ratio": rows["importance_sampling_ratio"][i][completion].tolist(),
        "weight": rows["sequence_weight"][i].tolist(),
        "version": rows["policy_version"][i].item(),
    }


def main(report_path: str) -> None:
    PartialState(cpu=True, backend="gloo")
    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    every = [rollout(r) for r in range(world)]
    lengths = [
        int(every[r]["prompt_mask"][i].sum() + every[r]["completion_mask"][i].sum())
        for r in range(world)
        for i in range(ROWS)
    ]
    assignment = balanced_rank_assignment(lengths, world, coefficient=10.0)
    moved = exchange_rows(every[rank], assignment[rank], ROWS, accelerator, ["sequence_weight"])
    expected = [sample(every[g // ROWS], g % ROWS) for g in assignment[rank]]
    got = [sample(moved, i) for i in range(moved["completion_ids"].size(0))]
    widest_prompt = max(len(s["prompt"]) for s in expected)
    widest_completion = max(len(s["completion"]) for s in expected)
    result = {
        "rank": rank,
        "kept": assignment[rank],
        "same_samples": got == expected,
        "prompt_width": moved["prompt_ids"].size(1),
        "widest_prompt": widest_prompt,
        "completion_width": moved["completion_ids"].size(1),
        "widest_completion": widest_completion,
        "logps_width": moved["old_per_token_logps"].size(1),
        "weight_shape": list(moved["sequence_weight"].shape),
        "ratio_width": moved["importance_sampling_ratio"].size(1),
        "ratio_padding_is_one": bool(
            (moved["importance_sampling_ratio"][~moved["completion_mask"].bool()] == 1.0).all()
        ),
        "tool_mask_dtype": str(moved["tool_mask"].dtype),
        "num_items_in_batch": moved["num_items_in_batch"].item(),
        "prompt_left_padded": bool((moved["prompt_mask"][:, -1] == 1).all()),
    }
    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        with open(report_path, "w") as handle:
            json.dump({"ranks": results, "lengths": lengths}, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    leave_group()
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
