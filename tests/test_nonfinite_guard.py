"""The non-finite guard: a NaN loss or gradient skips the optimizer step (weights, fp32 masters, Adam moments and the
critic untouched), is logged, and too many in a row stop the run with a clear error."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig
from transformers import TrainerCallback

from trlx_scale import DPOTrainer, GRPOTrainer, PPOConfig, PPOTrainer
from trlx_scale.reliability import NonFiniteTrainingError
from trlx_scale.tasks import addition_dataset, addition_preference_dataset, exact_match_reward

from .helpers.trainers import logged, small_dpo_config, small_grpo_config

LORA = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")


def alternating_reward(completions, **kwargs):
    """Varies within every group (the embedded model often samples a group's completions alike), so every step has
    a gradient."""
    return [float(index % 2) for index in range(len(completions))]


REWARDS = [exact_match_reward, alternating_reward]


class _PoisonLoss:
    """Mixed into a trainer: the loss of the optimizer steps listed in ``nan_steps`` (1-based) becomes NaN."""

    nan_steps: set[int] = set()

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if self.state.global_step + 1 in self.nan_steps:
            loss = loss * float("nan")
        return loss


class NaNGRPOTrainer(_PoisonLoss, GRPOTrainer):
    pass


class NaNPPOTrainer(_PoisonLoss, PPOTrainer):
    pass


class NaNDPOTrainer(_PoisonLoss, DPOTrainer):
    pass


class _Snapshots(TrainerCallback):
    """Every trainable tensor (and the optimizer's fp32 masters, if any) at the start of each optimizer step."""

    def __init__(self, tensors):
        self.tensors = tensors
        self.before: dict[int, list[torch.Tensor]] = {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.before[state.global_step + 1] = [t.detach().clone() for t in self.tensors()]


def _unchanged(first, second) -> bool:
    return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def _grpo(default_model_dir, tmp_path, nan_steps, **overrides):
    trainer = NaNGRPOTrainer(
        model=default_model_dir,
        reward_funcs=REWARDS,
        args=small_grpo_config(tmp_path, **{"max_steps": 3, **overrides}),
        train_dataset=addition_dataset("train", size=32),
        peft_config=LORA,
    )
    trainer.nan_steps = set(nan_steps)
    return trainer


@pytest.mark.parametrize("masters", [False, True], ids=["adamw", "fp32_masters"])
def test_a_nan_step_is_skipped_and_training_goes_on(default_model_dir, tmp_path, masters):
    trainer = _grpo(default_model_dir, tmp_path, nan_steps={2}, fp32_master_weights=masters, optim_preset=None)

    def tensors():
        model = [p for p in trainer.model.parameters() if p.requires_grad]
        optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
        masters_ = list(getattr(optimizer, "master_params", [])) if optimizer is not None else []
        return model + masters_

    snapshots = _Snapshots(tensors)
    trainer.add_callback(snapshots)
    trainer.train()
    final = [t.detach().clone() for t in tensors()]
    assert _unchanged(snapshots.before[2], snapshots.before[3])  # step 2 changed nothing, masters included
    assert not _unchanged(snapshots.before[1], snapshots.before[2])  # steps 1 and 3 did train
    assert not _unchanged(snapshots.before[3], final)
    assert all(math.isfinite(v) for t in final for v in t.flatten().tolist()[:50])
    assert logged(trainer, "reliability/skipped_steps") == [0.0, 1.0, 1.0]
    optimizer = trainer.optimizer.optimizer
    steps = {float(state["step"]) for state in optimizer.state.values()}
    assert steps == {2.0}  # Adam took 2 steps in 3: the skipped one left its moments and step count alone
    assert math.isnan(logged(trainer, "grad_norm")[1])
    assert trainer.policy_version == 2  # 3 steps, 2 updates: the skipped step made no new policy


def test_engine_syncs_only_when_the_policy_version_moved(default_model_dir, tmp_path):
    """The one "is the engine current" check: a skipped step leaves the policy version, so the engine is not synced
    again (the weights did not change); an update moves it, and the next rollout syncs."""
    trainer = _grpo(default_model_dir, tmp_path, nan_steps={2}, use_vllm=True, vllm_mode="colocate", max_steps=3)
    engine = trainer.vllm_generation
    syncs, versions = [], []
    original = engine._sync_weights

    def counting(base_discarded):
        syncs.append(trainer.state.global_step)
        return original(base_discarded)

    engine._sync_weights = counting
    finish_rollout = trainer._finish_rollout

    def recording(batch):
        versions.append(batch.policy_version)
        return finish_rollout(batch)

    trainer._finish_rollout = recording
    trainer.train()
    # Rollouts before steps 1, 2, 3 ran at versions 0, 1, 1 (step 2 was skipped); the engine synced for versions 0
    # and 1 only, at global steps 0 and 1.
    assert versions == [0, 1, 1]
    assert syncs == [0, 1], syncs
    assert engine.served_version == 1 and trainer.policy_version == 2


def test_consecutive_nan_steps_stop_the_run_with_a_clear_error(default_model_dir, tmp_path):
    trainer = _grpo(default_model_dir, tmp_path, nan_steps={1, 2, 3}, max_consecutive_skipped_steps=2)
    before = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
    with pytest.raises(NonFiniteTrainingError, match=r"2 optimizer steps in a row.*max_consecutive_skipped_steps"):
        trainer.train()
    after = [p.detach() for p in trainer.model.parameters() if p.requires_grad]
    assert _unchanged(before, after)
    assert trainer.skipped_steps == 2


def test_guard_off_lets_the_nan_through(default_model_dir, tmp_path):
    """The control: with the guard off the same NaN reaches the weights (so the test above can fail)."""
    trainer = _grpo(default_model_dir, tmp_path, nan_steps={1}, max_steps=1, max_consecutive_skipped_steps=0)
    trainer.train()
    assert any(not torch.isfinite(p).all() for p in trainer.model.parameters() if p.requires_grad)


def _ppo(default_model_dir, tmp_path, nan_steps):
    trainer = NaNPPOTrainer(
        model=default_model_dir,
        reward_funcs=REWARDS,
        args=small_grpo_config(tmp_path, PPOConfig, max_steps=3, critic_learning_rate=1e-3, seed=11),
        train_dataset=addition_dataset("train", size=32),
        peft_config=LORA,
    )
    trainer.nan_steps = set(nan_steps)
    return trainer


def test_ppo_nan_loss_skips_policy_and_critic(default_model_dir, tmp_path):
    trainer = _ppo(default_model_dir, tmp_path, nan_steps={2})
    snapshots = _Snapshots(lambda: list(trainer.critic.trainable_parameters()))
    trainer.add_callback(snapshots)
    trainer.train()
    assert _unchanged(snapshots.before[2], snapshots.before[3])
    assert not _unchanged(snapshots.before[1], snapshots.before[2])
    assert logged(trainer, "reliability/skipped_steps")[-1] == 1.0
    assert all(torch.isfinite(p).all() for p in trainer.critic.trainable_parameters())


def test_ppo_nan_in_the_critic_gradient_alone_skips_the_step(default_model_dir, tmp_path):
    """The policy's gradients are finite; only the critic's value head gets a NaN gradient at step 2."""
    trainer = _ppo(default_model_dir, tmp_path, nan_steps=set())
    head = trainer.critic.head.summary.weight
    head.register_hook(lambda grad: grad * float("nan") if trainer.state.global_step + 1 == 2 else grad)
    policy = _Snapshots(lambda: [p for p in trainer.model.parameters() if p.requires_grad])
    critic = _Snapshots(lambda: list(trainer.critic.trainable_parameters()))
    trainer.add_callback(policy)
    trainer.add_callback(critic)
    trainer.train()
    assert _unchanged(policy.before[2], policy.before[3])
    assert _unchanged(critic.before[2], critic.before[3])
    assert logged(trainer, "reliability/skipped_steps")[-1] == 1.0
    assert torch.isfinite(head).all()


def test_dpo_nan_loss_is_skipped(default_model_dir, tmp_path):
    trainer = NaNDPOTrainer(
        model=default_model_dir,
        args=small_dpo_config(tmp_path, max_steps=3),
        train_dataset=addition_preference_dataset(size=32),
        peft_config=LORA,
    )
    trainer.nan_steps = {2}
    snapshots = _Snapshots(lambda: [p for p in trainer.model.parameters() if p.requires_grad])
    trainer.add_callback(snapshots)
    trainer.train()
    assert _unchanged(snapshots.before[2], snapshots.before[3])
    assert not _unchanged(snapshots.before[1], snapshots.before[2])
    assert logged(trainer, "reliability/skipped_steps")[-1] == 1.0


def test_bad_guard_setting_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_consecutive_skipped_steps must be an integer >= 0"):
        small_grpo_config(tmp_path, max_consecutive_skipped_steps=-1)
