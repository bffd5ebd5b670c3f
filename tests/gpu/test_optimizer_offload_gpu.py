"""GPU only: optimizer states leave device memory during generation and come back intact."""

import pytest
import torch

from trlx_scale.optim.optimizer_offload import OptimizerStateOffloader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: this machine has none"),
]


def test_offload_frees_device_memory_and_restores_exactly():
    param = torch.nn.Parameter(torch.randn(1024, 1024, device="cuda"))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.randn_like(param)
    optimizer.step()
    saved = {k: v.clone() for k, v in optimizer.state[param].items() if v.dim() > 0}
    before = torch.cuda.memory_allocated()
    offloader = OptimizerStateOffloader(optimizer)
    moved = offloader.offload()
    assert moved == 2 * 1024 * 1024 * 4
    assert torch.cuda.memory_allocated() <= before - moved
    offloader.reload()
    for key, value in saved.items():
        assert optimizer.state[param][key].device.type == "cuda" and torch.equal(optimizer.state[param][key], value)
