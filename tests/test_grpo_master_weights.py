"""GRPOTrainer with an optimizer preset: bf16 model, fp32 masters, exact resume through the Trainer checkpoint."""

import os

import torch
from transformers import TrainerCallback

from trlx_scale import GRPOTrainer
from trlx_scale.optim.master_weights import MASTER_KEY, FP32MasterAdamW
from trlx_scale.tasks import addition_dataset, exact_match_reward

from .helpers.trainers import small_grpo_config


def _args(tmp_path, **overrides):
    values = dict(seed=3, optim_preset="grpo", output_dir=str(tmp_path / "out"))
    values.update(overrides)
    return small_grpo_config(values.pop("output_dir"), **values)


class _CaptureMasters(TrainerCallback):
    def __init__(self):
        self.at_first_step = None

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if self.at_first_step is None:
            inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate wraps it
            self.at_first_step = [m.detach().clone() for m in inner.master_params]


def test_preset_trains_a_bf16_model_with_fp32_masters_and_vllm(default_model_dir, tmp_path, capsys):
    trainer = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=_args(tmp_path, use_vllm=True, vllm_dtype="trainer", learning_rate=1e-4),
        train_dataset=addition_dataset("train", size=64),
    )
    printed = capsys.readouterr().out
    assert "optimizer preset 'grpo'" in printed and "learning_rate=0.0001 (user)" in printed
    assert "adam_beta2=0.95" in printed
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert trainer.vllm_generation.dtype == "bfloat16"
    trainer.train()
    optimizer = trainer.optimizer.optimizer  # AcceleratedOptimizer -> ours
    assert isinstance(optimizer, FP32MasterAdamW)
    assert all(m.dtype == torch.float32 for m in optimizer.master_params)
    for model_param, master in zip(optimizer.model_params, optimizer.master_params, strict=True):
        assert torch.equal(model_param.detach(), master.detach().to(torch.bfloat16))
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)


def test_trainer_checkpoint_restores_masters_bit_for_bit(default_model_dir, tmp_path):
    # Warmup starts at lr 0 (step 0), so checkpoint after the second step, when the masters have moved.
    args = _args(tmp_path, save_strategy="steps", save_steps=2, max_steps=3, warmup_steps=1, learning_rate=1e-4)
    first = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=addition_dataset("train", size=64),
    )
    first.train()
    checkpoint = os.path.join(args.output_dir, "checkpoint-2")
    saved = torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=False)[MASTER_KEY]
    # The bf16 model checkpoint alone cannot reproduce them: the masters carry the sub-bf16 part of the updates.
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in saved)

    capture = _CaptureMasters()
    resumed = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=_args(
            tmp_path,
            save_strategy="no",
            max_steps=3,
            warmup_steps=1,
            learning_rate=1e-4,
            output_dir=str(tmp_path / "resumed"),
        ),
        train_dataset=addition_dataset("train", size=64),
        callbacks=[capture],
    )
    resumed.train(resume_from_checkpoint=checkpoint)
    assert capture.at_first_step is not None and len(capture.at_first_step) == len(saved)
    assert all(torch.equal(a, b) for a, b in zip(capture.at_first_step, saved, strict=True))


def test_master_weights_refuse_a_user_optimizer(default_model, tmp_path):
    import pytest

    optimizer = torch.optim.AdamW(default_model.parameters(), lr=1e-6)
    with pytest.raises(ValueError, match="fp32_master_weights builds its own optimizer"):
        GRPOTrainer(
            model=default_model,
            reward_funcs=exact_match_reward,
            args=_args(tmp_path),
            train_dataset=addition_dataset("train", size=16),
            optimizers=(optimizer, None),
        )
