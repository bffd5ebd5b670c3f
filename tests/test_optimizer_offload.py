"""Optimizer-state offload around generation (trlx_scale.optim.optimizer_offload); its GPU test is tests/gpu/."""

import torch

from trlx_scale.optim.optimizer_offload import OptimizerStateOffloader


def test_optimizer_offload_moves_nothing_when_states_are_already_on_the_host():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(3)
    optimizer.step()
    state_before = {k: v for k, v in optimizer.state[param].items()}
    offloader = OptimizerStateOffloader(optimizer)
    assert offloader.offload() == 0 and offloader.reload() == 0
    assert all(optimizer.state[param][k] is v for k, v in state_before.items())
