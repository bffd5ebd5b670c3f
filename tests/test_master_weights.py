"""fp32 master weights: the failure they prevent, exact resume, and the memory they cost."""

import copy

import pytest
import torch

from trlx_scale.optim.master_weights import MASTER_KEY, FP32MasterAdamW

STEPS, LR = 100, 1e-6


def _weights(seed=0, shape=(64, 64)):
    """Weights of magnitude about 1 (bf16 spacing there is 2**-7; half of it is ~0.0039)."""
    generator = torch.Generator().manual_seed(seed)
    return 1.0 + 0.25 * torch.rand(shape, generator=generator)


def _gradients(step, shape=(64, 64)):
    """Noisy gradients with a consistent sign, so Adam moves every weight by about lr per step."""
    generator = torch.Generator().manual_seed(1000 + step)
    return 1.0 + 0.3 * torch.randn(shape, generator=generator)


def _run(param, optimizer, steps=STEPS, start=0):
    for step in range(start, start + steps):
        param.grad = _gradients(step).to(param.dtype)
        optimizer.step()
        optimizer.zero_grad()


def test_plain_bf16_adamw_loses_rl_sized_updates_and_masters_keep_them():
    """Expected, by hand: Adam moves each weight by about lr per step, so ~1e-4 after 100 steps; bf16 cannot
    represent a change below ~0.004 at magnitude 1, so pure bf16 stays bit-identical while the fp32 reference and the
    fp32 masters move by ~1e-4 and agree with each other."""
    initial = _weights()

    bf16 = torch.nn.Parameter(initial.to(torch.bfloat16))
    _run(bf16, torch.optim.AdamW([bf16], lr=LR, betas=(0.9, 0.95), weight_decay=0.0))
    assert torch.equal(bf16.detach(), initial.to(torch.bfloat16)), "pure bf16 AdamW should have lost every update"

    reference = torch.nn.Parameter(initial.clone())
    _run(reference, torch.optim.AdamW([reference], lr=LR, betas=(0.9, 0.95), weight_decay=0.0))
    moved = (reference.detach() - initial).abs()
    assert 5e-5 < moved.mean() < 1.5e-4  # the fp32 run really moved, by about STEPS * LR

    model_param = torch.nn.Parameter(initial.to(torch.bfloat16))
    optimizer = FP32MasterAdamW([model_param], lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    _run(model_param, optimizer)
    (master,) = optimizer.master_params
    assert master.dtype == torch.float32 and model_param.dtype == torch.bfloat16
    # The masters started from the bf16-rounded weights and saw bf16-rounded gradients; their displacement matches
    # the fp32 reference's up to fp32 rounding at magnitude 1 (~6e-8 a step, so <1e-5 after 100 steps, a tenth of
    # the ~1e-4 displacement; pure bf16 would be off by the whole displacement).
    displacement = master.detach() - initial.to(torch.bfloat16).float()
    reference_displacement = reference.detach() - initial
    assert torch.allclose(displacement, reference_displacement, rtol=0.05, atol=1e-5)
    # The model copy is the rounded master.
    assert torch.equal(model_param.detach(), master.detach().to(torch.bfloat16))


def test_masters_push_bf16_weights_once_updates_accumulate():
    """With a larger step the accumulated master change crosses bf16 spacing and the model weight follows."""
    model_param = torch.nn.Parameter(_weights().to(torch.bfloat16))
    before = model_param.detach().clone()
    optimizer = FP32MasterAdamW([model_param], lr=1e-3)
    _run(model_param, optimizer, steps=20)
    assert not torch.equal(model_param.detach(), before)


def test_resume_restores_masters_bit_for_bit_and_continues_identically():
    model_a = torch.nn.Parameter(_weights().to(torch.bfloat16))
    optimizer_a = FP32MasterAdamW([model_a], lr=1e-4, betas=(0.9, 0.95))
    _run(model_a, optimizer_a, steps=10)
    checkpoint = copy.deepcopy(optimizer_a.state_dict())
    weights_checkpoint = model_a.detach().clone()  # what the model checkpoint holds: bf16
    _run(model_a, optimizer_a, steps=10, start=10)

    model_b = torch.nn.Parameter(weights_checkpoint.clone())
    optimizer_b = FP32MasterAdamW([model_b], lr=1e-4, betas=(0.9, 0.95))
    optimizer_b.load_state_dict(checkpoint)
    assert torch.equal(optimizer_b.master_params[0], checkpoint[MASTER_KEY][0])
    assert not torch.equal(optimizer_b.master_params[0], weights_checkpoint.float()), "masters carry more than bf16"
    _run(model_b, optimizer_b, steps=10, start=10)
    assert torch.equal(optimizer_a.master_params[0], optimizer_b.master_params[0])
    assert torch.equal(model_a.detach(), model_b.detach())


def test_bad_inputs_have_clear_errors():
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    with pytest.raises(ValueError, match="frozen parameter"):
        FP32MasterAdamW([frozen])
    with pytest.raises(ValueError, match="no parameters"):
        FP32MasterAdamW([])
    shared = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="more than one parameter group"):
        FP32MasterAdamW([{"params": [shared]}, {"params": [shared]}])
    optimizer = FP32MasterAdamW([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="not saved by FP32MasterAdamW"):
        optimizer.load_state_dict(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]).state_dict())


def test_lr_scheduler_drives_the_master_optimizer():
    param = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    optimizer = FP32MasterAdamW([param], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)
    param.grad = torch.ones_like(param)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)


def _step_once(model, optimizer):
    ids = torch.tensor([[3, 20, 21, 22, 4, 30, 1]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def test_memory_per_parameter_matches_the_documented_table(default_model):
    """docs/optimizers.md: fp32 16 B/param (4 weight + 4 grad + 8 moments); bf16 + fp32 master 16 B/param
    (2 weight + 2 grad + 4 master + 8 moments; masters' grads are dropped after each step); LoRA: 2 B per frozen
    base parameter + 16 B per adapter parameter."""
    from trlx_scale.optim.memory import training_state_bytes

    numel = sum(p.numel() for p in default_model.parameters())

    fp32_model = copy.deepcopy(default_model)
    fp32_optimizer = torch.optim.AdamW(fp32_model.parameters(), lr=1e-6)
    _step_once(fp32_model, fp32_optimizer)
    fp32 = training_state_bytes(fp32_model, fp32_optimizer)
    assert fp32 == {"weights": 4 * numel, "gradients": 4 * numel, "masters": 0, "moments": 8 * numel}

    bf16_model = copy.deepcopy(default_model).to(torch.bfloat16)
    master_optimizer = FP32MasterAdamW(bf16_model.parameters(), lr=1e-6)
    _step_once(bf16_model, master_optimizer)
    for master in master_optimizer.master_params:
        master.grad = None  # zero_grad(set_to_none) drops them; what stays between steps
    master = training_state_bytes(bf16_model, master_optimizer)
    assert master == {"weights": 2 * numel, "gradients": 2 * numel, "masters": 4 * numel, "moments": 8 * numel}
    assert sum(master.values()) == sum(fp32.values()) == 16 * numel

    from peft import LoraConfig, get_peft_model

    lora_model = get_peft_model(copy.deepcopy(default_model), LoraConfig(r=8, target_modules="all-linear"))
    lora_model.to(torch.bfloat16)
    adapters = [p for p in lora_model.parameters() if p.requires_grad]
    adapter_numel = sum(p.numel() for p in adapters)
    lora_optimizer = FP32MasterAdamW(adapters, lr=1e-6)
    _step_once(lora_model, lora_optimizer)
    lora_optimizer.zero_grad()
    lora = training_state_bytes(lora_model, lora_optimizer)
    assert lora["weights"] == 2 * (numel + adapter_numel)
    assert lora["masters"] == 4 * adapter_numel and lora["moments"] == 8 * adapter_numel
    assert lora["gradients"] == 0  # after zero_grad; during backward: 2 B per adapter parameter


def test_a_group_added_later_gets_masters_and_its_own_learning_rate():
    """PPO's shared-base critic joins the policy's optimizer as a group of its own: its bf16 parameters get fp32
    masters, are stepped at the group's learning rate, and cannot be added twice."""
    policy = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    critic = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    optimizer = FP32MasterAdamW([policy], lr=1e-3, weight_decay=0.0)
    optimizer.add_trainable_group({"params": [critic], "lr": 0.5, "weight_decay": 0.0})
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 0.5]
    assert all(m.dtype == torch.float32 for m in optimizer.master_params)
    policy.grad, critic.grad = torch.ones_like(policy), torch.ones_like(critic)
    optimizer.step()
    # Adam's first step moves each weight by its learning rate: the critic's by 0.5, the policy's by 1e-3 (lost in
    # bf16 rounding of 1.0, kept in its master).
    assert torch.equal(critic.detach(), torch.full((4,), 0.5, dtype=torch.bfloat16))
    assert torch.allclose(optimizer.master_params[0], torch.full((4,), 1 - 1e-3))
    with pytest.raises(ValueError, match="more than one parameter group"):
        optimizer.add_trainable_group({"params": [critic]})
