"""What every trlx_scale trainer gets from TrainerFeatures (trainer_features.py), seen in what it does: each trainer's
step is timed, guarded and counted as a policy version, and no path of a step (DPO's batch without pairs) skips the
profiler or the guard."""

from __future__ import annotations

import pytest
import torch

from trlx_scale import DPOConfig, DPOTrainer, GRPOTrainer, PPOConfig, PPOTrainer
from trlx_scale.trl_config_upgrade import as_trlx_config

from .helpers.trainers import small_dpo_config, small_grpo_config

TRAINERS = (GRPOTrainer, PPOTrainer, DPOTrainer)
# What each trainer's checkpoints hold beside transformers' own, in the order the parts are saved and loaded.
EXPECTED_CHECKPOINT_PARTS = {
    GRPOTrainer: ["policy_version", "rollout_buffer"],
    PPOTrainer: ["policy_version", "rollout_buffer", "ppo_critic_and_kl"],
    DPOTrainer: ["policy_version", "dpo_token_count"],
}


def _one_step_trainer(trainer_cls, model_dir, tmp_path):
    from trlx_scale.tasks import addition_dataset, addition_preference_dataset, exact_match_reward

    if trainer_cls is DPOTrainer:
        return DPOTrainer(
            model_dir,
            args=small_dpo_config(tmp_path, DPOConfig, max_steps=1, logging_steps=1),
            train_dataset=addition_preference_dataset(size=8),
        )
    config_cls = PPOConfig if trainer_cls is PPOTrainer else None
    return trainer_cls(
        model_dir,
        exact_match_reward,
        small_grpo_config(tmp_path, config_cls, max_steps=1, logging_steps=1),
        train_dataset=addition_dataset("train", size=8),
    )


@pytest.mark.parametrize("trainer_cls", TRAINERS, ids=lambda c: c.__name__)
def test_every_trainer_profiles_guards_and_versions_its_step(trainer_cls, default_model_dir, tmp_path):
    """What every trainer gets from TrainerFeatures, seen in its logs: the step is timed, the non-finite guard
    counted it, and the policy version moved by the one optimizer step."""
    trainer = _one_step_trainer(trainer_cls, default_model_dir, tmp_path)
    assert trainer.features_ready and trainer.policy_version == 0
    assert trainer.checkpoint_parts.names() == EXPECTED_CHECKPOINT_PARTS[trainer_cls]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs and logs[0]["time/loss_forward_backward"] > 0
    assert logs[0]["reliability/skipped_steps"] == 0.0
    assert trainer.policy_version == 1


def test_a_plain_trl_config_becomes_ours_with_trls_values_and_plain_trl_meanings():
    """A plain trl.GRPOConfig is upgraded once: TRL's fields as the user's config holds them (not processed again),
    every trlx_scale field at what a plain TRL config means (TRL's engine dtype, padded rows, ...), the user's object
    untouched, and a config of another kind refused by name."""
    import trl

    from trlx_scale import GRPOConfig

    plain = trl.GRPOConfig(output_dir="unused", report_to="none", bf16=False, learning_rate=3e-4, num_generations=4)
    typed = as_trlx_config(plain, GRPOConfig, trl.GRPOConfig)
    assert type(typed) is GRPOConfig and typed is not plain and not hasattr(plain, "shared_prefix")
    for name in ("learning_rate", "num_generations", "output_dir", "lr_scheduler_type", "bf16", "report_to"):
        assert getattr(typed, name) == getattr(plain, name), name
    assert typed.vllm_dtype == "auto" and typed.vllm_per_request_seed is False  # TRL's engine exactly
    assert typed.shared_prefix == "false" and typed.balance_ranks == "false" and typed.padding_free is False
    assert typed.uses_fp32_master_weights is False and typed.optim_preset_values is None
    assert typed.loss_recipe_values is None and typed.profile_phases is True  # a trlx_scale default elsewhere
    ours = GRPOConfig(output_dir="unused", report_to="none", bf16=False)
    assert as_trlx_config(ours, GRPOConfig, trl.GRPOConfig) is ours and ours.shared_prefix == "auto"
    with pytest.raises(TypeError, match="args must be a trlx_scale.GRPOConfig or a trl.GRPOConfig, got DPOConfig"):
        as_trlx_config(trl.DPOConfig(output_dir="unused", report_to="none", bf16=False), GRPOConfig, trl.GRPOConfig)


def test_weights_loaded_from_a_checkpoint_are_sent_to_the_engine_again(default_model_dir, tmp_path):
    """A checkpoint (or the best model at the end) replaces the weights outside the optimizer: whatever the version
    numbers say, the engine no longer serves them, and its next round syncs."""
    from trlx_scale.tasks import addition_dataset, exact_match_reward

    args = small_grpo_config(
        tmp_path, use_vllm=True, vllm_mode="colocate", max_steps=1, save_strategy="steps", save_steps=1
    )
    trainer = GRPOTrainer(default_model_dir, exact_match_reward, args, train_dataset=addition_dataset("train", size=8))
    trainer.train()
    engine = trainer.vllm_generation
    assert engine.served_version == 0 and trainer.policy_version == 1
    trainer._load_from_checkpoint(str(tmp_path / "checkpoint-1"))
    assert engine.served_version is None
    assert engine.ensure_version(trainer.policy_version) and engine.served_version == 1


def _unanimous_reward(completions, **kwargs):
    """Every sample of every prompt scores the same: no preference pair in any batch."""
    return [1.0] * len(completions)


def test_dpo_batch_without_pairs_goes_through_the_profiler_and_the_guard(default_model_dir, tmp_path):
    """Online DPO's early return (no pair to learn from) used to skip the profiler's and the guard's step."""
    from trlx_scale.tasks import addition_dataset

    args = small_dpo_config(
        tmp_path,
        DPOConfig,
        online=True,
        online_num_generations=2,
        online_max_completion_length=4,
        max_steps=1,
    )
    trainer = DPOTrainer(
        default_model_dir,
        args=args,
        train_dataset=addition_dataset("train", size=8),
        reward_funcs=_unanimous_reward,
    )
    noted = []
    original = trainer.nonfinite_guard.note_loss
    trainer.nonfinite_guard.note_loss = lambda loss: (noted.append(float(loss)), original(loss))[1]
    trainer.train()
    assert noted == [0.0]
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert logs and logs[0]["time/loss_forward_backward"] > 0
    assert logs[0]["reliability/skipped_steps"] == 0.0
    assert torch.isfinite(torch.tensor(logs[0]["loss"]))
