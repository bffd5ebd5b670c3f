"""GPU only: vLLM 0.32's NCCL weight transfer delivers a changed policy to a real server, and the probe sees it.

Not run on this project's CPU machines (no CUDA) nor on its lent GPU machine (no vLLM there): until a run on a
machine with both says otherwise, the NCCL transport is written against vLLM's API and unverified (docs/async.md)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: this machine has none"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM with CUDA on this machine"),
]


def test_nccl_delivery_changes_what_the_server_serves(default_model_dir):
    from transformers import AutoModelForCausalLM

    from trlx_scale.generation.server_client import SamplingSettings, VLLMServerClient
    from trlx_scale.generation.server_weight_transports import NCCLWeightTransport
    from trlx_scale.generation.vllm_server import ServerLaunch, VLLMServerProcess

    launch = ServerLaunch(
        model=default_model_dir, dtype="float32", enable_lora=False, devices="1", weight_transfer="nccl"
    )
    process = VLLMServerProcess(launch, startup_timeout=600).start()
    try:
        client = VLLMServerClient(
            [launch.url], model=default_model_dir, sampling=SamplingSettings(max_tokens=4), request_timeout=300
        )
        model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).to("cuda:0")
        probe = list(range(5, 21))
        before = torch.tensor(client.prompt_logprobs(probe, 0)[0])
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01 * torch.randn_like(param))
        accelerator = SimpleNamespace(is_main_process=True, process_index=0, num_processes=1, device=model.device)
        transport = NCCLWeightTransport(accelerator, client, torch.float32, server_world_size=1)
        transport.deliver(model, 1)
        after = torch.tensor(client.prompt_logprobs(probe, 1)[0])
        ids = torch.tensor([probe], device=model.device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        trainer = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu()
        assert (after - trainer).abs().max().item() < 1e-3
        assert (after - before).abs().max().item() > 1e-3
        transport.close()
    finally:
        process.stop()
