"""Run under torchrun (2 processes, gloo, CPU): a LoRA policy sharded with FSDP2 (raw fully_shard) hands vLLM the
same adapter as the unsharded model, gathering only the LoRA tensors. Writes a JSON report from rank 0."""

import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from report import finish  # tests/distributed/report.py (the script's folder)
from safetensors.torch import load_file
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from trlx_scale.generation.weight_sync import LoRAAdapterSync
from trlx_scale.tasks.default_model import default_model_path


def build():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():  # non-zero B so that the adapter is not trivially all zeros
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model


def main() -> dict:
    dist.init_process_group("gloo")
    reference = {k: v.clone() for k, v in get_peft_model_state_dict(build()).items()}
    model = build()
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    sync = LoRAAdapterSync(model, lambda params: nullcontext(), torch.float32)
    sent = sync.write_adapter()
    written = load_file(f"{sync.directory}/adapter_model.safetensors")
    report = {
        "lora_params_sharded": all(isinstance(p, DTensor) for p in lora),
        "local_fraction": sum(p.to_local().numel() for p in lora) / sum(p.numel() for p in lora),
        "same_keys": sorted(written) == sorted(reference),
        "max_abs_diff": max((written[k] - reference[k]).abs().max().item() for k in reference),
        "bytes_sent": sent,
        "adapter_bytes": sum(v.numel() * 4 for v in reference.values()),
    }
    return report


if __name__ == "__main__":
    # main() returns first, so the sharded model and its pending collectives are freed while the group is alive.
    finish(main(), sys.argv[1])
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
