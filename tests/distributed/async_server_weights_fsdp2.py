"""Run under torchrun (2 processes, gloo, CPU) against a real ``vllm serve`` (its URL the first argument): the
asynchronous trainer's weight path (``ServerGeneration.ensure_version``) from an FSDP2-sharded policy (raw
``fully_shard``, as Accelerate shards it; Accelerate runs FSDP only on accelerators). Three ways a policy reaches the
server: full weights, a LoRA policy merged into full weights, and the LoRA adapter alone. For each:

- version 0's files are those of the same model unsharded (the gathered, merged tensors equal to what PEFT's own
  ``merge_adapter`` gives on one process), and the server verifies them (the probe, within 1e-3 in fp32);
- one optimizer step later, version 1 is sent (after a forward, which leaves FSDP2's root parameters unsharded)
  and verified too, and the probe's log-probs moved by more than the tolerance, so the verification tells the two
  versions apart.

Writes a JSON report from rank 0."""

import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from fsdp2_models import build_fsdp2_model  # tests/distributed/ (the script's folder)
from peft import get_peft_model_state_dict
from report import finish
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from trlx_scale.generation import server_weights
from trlx_scale.generation.server_client import SamplingSettings, VLLMServerClient
from trlx_scale.generation.server_generation import ServerGeneration
from trlx_scale.rollout.async_producer import RolloutProducer
from trlx_scale.rollout.staleness import StalenessSchedule
from trlx_scale.tasks.default_model import default_model_path

PROBE = [1, 17, 42, 99, 7, 23, 5, 64, 11, 30]  # any token ids: their log-probs are compared
VARIANTS = {"full": ("full", "full"), "lora_merged": ("lora", "full"), "lora_adapter": ("lora", "lora")}


def unsharded_reference(kind: str) -> dict[str, torch.Tensor]:
    """What one process writes for the same model: PEFT's merge_adapter, then write_full_weights' tensors."""
    model = build_fsdp2_model(kind, False, shard=False)
    if kind == "lora":
        model.merge_adapter()
    path = server_weights.write_full_weights(model, f"/tmp/trlx-scale-fsdp2-ref-{os.getpid()}-{kind}")
    tensors = load_file(os.path.join(path, server_weights.WEIGHTS_FILE))
    server_weights.remove_version(path)
    return tensors


def restore_base(accelerator: Accelerator, url: str) -> None:
    """Put the server's base weights back (earlier tests and variants reloaded it with theirs)."""
    if accelerator.is_main_process:
        base = build_fsdp2_model("full", False, shard=False)
        path = server_weights.write_full_weights(base, f"/tmp/trlx-scale-fsdp2-base-{os.getpid()}")
        VLLMServerClient([url], model=default_model_path(), sampling=SamplingSettings(4)).reload_weights(0, path)
        server_weights.remove_version(path)
    accelerator.wait_for_everyone()


def one_step(model: torch.nn.Module) -> None:
    """An optimizer step large enough to move the probe's log-probs well past the verification tolerance."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.tensor([PROBE])
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
    loss = -torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None]).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def run_variant(accelerator: Accelerator, url: str, name: str) -> dict:
    kind, sync_mode = VARIANTS[name]
    restore_base(accelerator, url)
    model = build_fsdp2_model(kind, False)
    report = {"sharded": all(isinstance(p, DTensor) for p in model.parameters())}
    client = VLLMServerClient(
        [url], model=default_model_path(), sampling=SamplingSettings(4), request_timeout=120, lora=sync_mode == "lora"
    )
    schedule = StalenessSchedule(groups_per_version=1, max_staleness=1)
    producer = RolloutProducer(  # never started: ensure_version only holds and publishes through it
        prompt_for=lambda index: None,
        sampler=client,
        score=None,
        schedule=schedule,
        num_generations=2,
        seed=0,
        max_inflight_tasks=1,
        queue_maxsize=1,
    )
    version = {"current": 0}
    generation = ServerGeneration(
        model=model,
        accelerator=accelerator,
        client=client,
        producer=producer,
        schedule=schedule,
        policy_version=lambda: version["current"],
        probe_ids=PROBE,
        verify_tolerance=1e-3,
        request_timeout=120,
    )
    try:
        generation.ensure_version(0)  # raises WeightDeliveryError if the server's probe differs
        probe_0 = generation._last_probe.clone()
        if accelerator.is_main_process:
            written_dir = generation.transport.files.directories[0]
            if sync_mode == "full":
                written = load_file(os.path.join(written_dir, server_weights.WEIGHTS_FILE))
                reference = unsharded_reference(kind)
                report["same_names"] = sorted(written) == sorted(reference)
                report["max_abs_diff"] = max((written[k] - reference[k]).abs().max().item() for k in reference)
            else:
                written = load_file(os.path.join(written_dir, server_weights.ADAPTER_FILE))
                reference = get_peft_model_state_dict(build_fsdp2_model(kind, False, shard=False))
                report["same_names"] = sorted(written) == sorted(reference)
                report["max_abs_diff"] = max((written[k] - reference[k]).abs().max().item() for k in reference)
        report["gap_v0"] = generation.pop_metrics()["sync/probe_logprob_gap"] if accelerator.is_main_process else None
        one_step(model)
        # FSDP2 keeps the root module's parameters unsharded after a forward (plain tensors until the next
        # backward). Version 1 is sent from that state: every rank must still gather alike.
        with torch.no_grad():
            model(input_ids=torch.tensor([PROBE]), use_cache=False)
        report["root_unsharded_at_send"] = not all(isinstance(p, DTensor) for p in model.parameters())
        version["current"] = 1
        generation.ensure_version(1)
        report["probe_moved"] = (generation._last_probe - probe_0).abs().max().item()
        report["gap_v1"] = generation.pop_metrics()["sync/probe_logprob_gap"] if accelerator.is_main_process else None
        return report
    finally:
        generation.close()


def main(url: str) -> dict:
    accelerator = Accelerator(cpu=True)
    assert dist.get_world_size() == 2
    return {name: run_variant(accelerator, url, name) for name in VARIANTS}


if __name__ == "__main__":
    # main() returns first, so the sharded models and their pending collectives are freed while the group is alive.
    finish(main(sys.argv[1]), sys.argv[2])
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
