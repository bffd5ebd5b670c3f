"""Run under torchrun (2 processes, gloo, CPU): a full (non-PEFT) policy sharded with FSDP2 streams to vLLM exactly
the unsharded weights, gathered parameter by parameter. Writes a JSON report from rank 0."""

import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from report import finish  # tests/distributed/report.py (the script's folder)
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from trlx_scale.generation.weight_sync import full_weight_stream, is_fsdp2_sharded
from trlx_scale.tasks.default_model import default_model_path


def main() -> dict:
    dist.init_process_group("gloo")
    reference = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    expected = {n: p.detach().clone() for n, p in reference.named_parameters()}
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    counter = {}
    streamed = dict(
        full_weight_stream(
            list(model.named_parameters()), lambda params: nullcontext(), torch.bfloat16, 2**20, counter
        )
    )
    report = {
        "sharded": is_fsdp2_sharded(model),
        "same_names": sorted(streamed) == sorted(expected),
        "all_full_shape": all(streamed[n].shape == expected[n].shape for n in expected),
        "max_abs_diff_bf16": max(
            (streamed[n].float() - expected[n].to(torch.bfloat16).float()).abs().max().item() for n in expected
        ),
        "dtypes": sorted({str(t.dtype) for t in streamed.values()}),
        "bytes": counter["bytes"],
        "expected_bytes": sum(p.numel() * 2 for p in expected.values()),
    }
    return report


if __name__ == "__main__":
    # main() returns first, so the sharded model and its pending collectives are freed while the group is alive.
    finish(main(), sys.argv[1])
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
