"""Two gloo processes reduce different step records: times by MAX, tokens and FLOPs by SUM.

torchrun --nproc_per_node 2 tests/distributed/profile_reduction.py REPORT_JSON
"""

import json
import sys

import torch.distributed as dist

from trlx_scale.profiling.trainer_profiling import StepRecord, summarize_steps


def main(report_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Rank 1 is slower in generation, rank 0 in the loss; each generated different token counts.
    records = [
        StepRecord(
            seconds=2.0 + rank,
            phases={"generation": 1.0 + 2 * rank, "loss_forward_backward": 0.8 - 0.5 * rank},
            counters={"generated_tokens": 100 * (rank + 1), "trained_tokens": 10, "flops": 4e12},
        ),
        StepRecord(seconds=1.0, phases={"generation": 0.5}, counters={"generated_tokens": 50, "flops": 2e12}),
    ]
    metrics = summarize_steps(records, world=2, peak_tflops=10.0, profiler_seconds=0.001 * (rank + 1))
    if rank == 0:
        with open(report_path, "w") as handle:
            json.dump(metrics, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
