"""generation/server_weight_transports.py: which transport a run gets, and vLLM's NCCL transfer refused by name where
it cannot run (the files transports are exercised against a real server in tests/test_async_grpo.py, NCCL on a GPU
in tests/gpu/test_nccl_weight_transfer_gpu.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from trlx_scale.generation.server_weight_transports import (
    AdapterFilesTransport,
    FullWeightFilesTransport,
    NCCLTransportUnavailable,
    build_server_transport,
    nccl_unavailable_reason,
)
from trlx_scale.generation.vllm_server import ServerLaunch


def _client(lora: bool, urls=("http://127.0.0.1:8000",)):
    return SimpleNamespace(lora=lora, base_urls=list(urls), request_timeout=60)


ACCELERATOR = SimpleNamespace(
    is_main_process=True,
    process_index=0,
    num_processes=1,
    device=torch.device("cpu"),
    state=SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=None),
)


def test_files_transport_follows_the_sync_mode():
    adapter = build_server_transport("files", accelerator=ACCELERATOR, client=_client(True), weights_dtype=None)
    full = build_server_transport(
        "files", accelerator=ACCELERATOR, client=_client(False), weights_dtype=torch.bfloat16
    )
    assert isinstance(adapter, AdapterFilesTransport)
    assert isinstance(full, FullWeightFilesTransport) and full.weights_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="vllm_server_weight_transfer must be one of"):
        build_server_transport("ipc", accelerator=ACCELERATOR, client=_client(False), weights_dtype=None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_nccl_is_refused_without_cuda_naming_the_fix():
    with pytest.raises(NCCLTransportUnavailable, match="no CUDA device.*vllm_server_weight_transfer='files'"):
        build_server_transport("nccl", accelerator=ACCELERATOR, client=_client(False), weights_dtype=None)


def test_nccl_refusal_reasons():
    assert nccl_unavailable_reason(True, True, 1, lora=False) is None
    assert "no CUDA device" in nccl_unavailable_reason(False, True, 1, lora=False)
    assert "needs vLLM installed" in nccl_unavailable_reason(True, False, 1, lora=False)
    assert "2 server URLs" in nccl_unavailable_reason(True, True, 2, lora=False)
    assert "vllm_sync_mode='full'" in nccl_unavailable_reason(True, True, 1, lora=True)
    assert "sharded (ZeRO-3 or FSDP2)" in nccl_unavailable_reason(True, True, 1, lora=False, sharded=True)


def test_a_server_the_trainer_starts_gets_the_weight_transfer_config():
    launch = ServerLaunch(model="m", port=8000, weight_transfer="nccl")
    argv = launch.arguments(python="python")
    config = argv[argv.index("--weight-transfer-config") + 1]
    assert json.loads(config) == {"backend": "nccl"}
    assert "--weight-transfer-config" not in ServerLaunch(model="m", port=8000).arguments(python="python")
