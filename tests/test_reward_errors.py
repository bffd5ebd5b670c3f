"""Reward functions that fail: the error names the function, the sample and its completion, on every rank;
reward_errors='skip' scores such samples NaN and counts them; inf is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig

from trlx_scale import GRPOTrainer
from trlx_scale.reliability import RewardFunctionError
from trlx_scale.reliability.reward_guard import GuardedRewardFunction, guard_reward_functions
from trlx_scale.tasks import addition_dataset, exact_match_reward

from .helpers.launch import LAUNCH_VARIABLES, REPO_ROOT
from .helpers.trainers import logged, small_grpo_config

LORA = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")


def fails_on_even_samples(completions, sample_ids, **kwargs):
    for sample in sample_ids:
        if sample % 2 == 0:
            raise ZeroDivisionError(f"sample {sample} divides by zero")
    return [1.0 for _ in completions]


def test_guard_locates_the_failing_sample_and_keeps_the_others():
    guarded = GuardedRewardFunction(fails_on_even_samples, mode="skip")
    rewards = guarded(prompts=["a", "b", "c"], completions=["x", "y", "z"], sample_ids=[1, 2, 3], trainer_state=None)
    assert rewards == [1.0, None, 1.0]  # only sample 1 (id 2) failed; the batch call failed as a whole
    assert guarded.pop_report() == ([], 1)
    assert guarded.__name__ == "fails_on_even_samples"  # TRL's metric names come from it

    strict = GuardedRewardFunction(fails_on_even_samples, mode="raise")
    strict(prompts=["a", "b"], completions=["x", "long completion " * 40], sample_ids=[1, 2])
    errors, skipped = strict.pop_report()
    assert skipped == 0 and len(errors) == 1
    assert "reward function 'fails_on_even_samples' raised ZeroDivisionError: sample 2 divides by zero" in errors[0]
    assert "on sample 1 of this rank's batch" in errors[0] and "reward_errors='skip'" in errors[0]
    assert "long completion " in errors[0] and "..." in errors[0]  # the completion, truncated


def test_a_batch_that_fails_once_and_then_scores_is_counted_and_warned_once(caplog):
    """A transient failure (the batch call raises, every sample then scores) is no error, but it cost one call per
    sample more: counted as a retry, and the first one of the function logged with the batch's error."""
    calls = []

    def flaky_judge(completions, **kwargs):
        calls.append(len(completions))
        if len(completions) > 1:
            raise TimeoutError("judge timed out")
        return [0.5]

    guarded = GuardedRewardFunction(flaky_judge, mode="raise")
    with caplog.at_level("WARNING", logger="trlx_scale.reliability.reward_guard"):
        assert guarded(prompts=["a", "b", "c"], completions=["x", "y", "z"]) == [0.5, 0.5, 0.5]
        assert guarded(prompts=["a", "b"], completions=["x", "y"]) == [0.5, 0.5]
    assert calls == [3, 1, 1, 1, 2, 1, 1]  # N+1 calls per batch
    assert guarded.pop_report() == ([], 0) and guarded.pop_retries() == 2 and guarded.pop_retries() == 0
    warnings = [r.getMessage() for r in caplog.records if "flaky_judge" in r.getMessage()]
    assert len(warnings) == 1 and "TimeoutError: judge timed out on a batch of 3" in warnings[0]


def test_grpo_logs_the_retries_of_a_transient_reward_failure(default_model_dir, tmp_path):
    def fails_every_other_batch(completions, **kwargs):
        fails_every_other_batch.batches += len(completions) > 1
        if len(completions) > 1 and fails_every_other_batch.batches % 2:
            raise ConnectionError("verifier unreachable")
        return [1.0] * len(completions)

    fails_every_other_batch.batches = 0
    trainer = _trainer(default_model_dir, tmp_path, [exact_match_reward, fails_every_other_batch])
    trainer.train()
    assert trainer.state.global_step == 2
    assert logged(trainer, "reliability/reward_retries") == [1.0]  # the first step's batch; the second's scored


def test_all_none_rewards_warn_with_trls_logger_and_words(default_model_dir, tmp_path, caplog):
    """A user's log filter or test keyed on TRL's warning still sees it."""

    def abstains(completions, **kwargs):
        return [None] * len(completions)

    trainer = _trainer(default_model_dir, tmp_path, [abstains], max_steps=1)
    with caplog.at_level("WARNING", logger="trl.trainer.grpo_trainer"):
        trainer.train()
    messages = [r.getMessage() for r in caplog.records if r.name == "trl.trainer.grpo_trainer"]
    # accelerate's logger (TRL's) prefixes the rank
    assert any("All reward functions returned None for the following kwargs:\n" in m for m in messages)
    assert any("'completion':" in m and "'prompt':" in m for m in messages)


def test_reward_models_and_async_functions_are_left_alone():
    async def async_reward(completions, **kwargs):
        return [0.0 for _ in completions]

    module = torch.nn.Linear(1, 1)
    guarded = guard_reward_functions([exact_match_reward, module, async_reward, "org/reward-model"], "raise")
    assert isinstance(guarded[0], GuardedRewardFunction)
    assert guarded[1:] == [module, async_reward, "org/reward-model"]


def _trainer(default_model_dir, tmp_path, reward_funcs, **overrides):
    return GRPOTrainer(
        model=default_model_dir,
        reward_funcs=reward_funcs,
        args=small_grpo_config(tmp_path, **overrides),
        train_dataset=addition_dataset("train", size=32),
        peft_config=LORA,
    )


def test_grpo_reward_exception_names_function_sample_and_completion(default_model_dir, tmp_path):
    def always_fails(completions, **kwargs):
        raise RuntimeError("scorer offline")

    trainer = _trainer(default_model_dir, tmp_path, [exact_match_reward, always_fails])
    with pytest.raises(
        RewardFunctionError,
        match=r"rank 0: reward function 'always_fails' raised RuntimeError: "
        r"scorer offline on sample 0 of this rank's batch \(prompt .*, completion .*\)",
    ):
        trainer.train()
    assert trainer.state.global_step == 0


def test_grpo_skip_mode_scores_nan_counts_and_trains(default_model_dir, tmp_path):
    def fails_on_half(completions, **kwargs):
        if len(completions) > 1:
            raise ValueError("batch call fails")  # per sample: every other sample fails
        fails_on_half.calls += 1
        if fails_on_half.calls % 2:
            raise ValueError("odd sample")
        return [1.0]

    fails_on_half.calls = 0
    trainer = _trainer(default_model_dir, tmp_path, [exact_match_reward, fails_on_half], reward_errors="skip")
    trainer.train()
    assert trainer.state.global_step == 2
    assert logged(trainer, "reliability/reward_errors") == [4.0, 4.0]  # 8 samples per step, half failed


def test_infinite_reward_is_refused_with_the_function_name(default_model_dir, tmp_path):
    def unbounded(completions, **kwargs):
        return [float("inf")] + [0.0] * (len(completions) - 1)

    trainer = _trainer(default_model_dir, tmp_path, [unbounded], reward_errors="skip")
    with pytest.raises(RewardFunctionError, match=r"reward function 'unbounded' returned inf for sample 0"):
        trainer.train()


def test_reward_errors_setting_is_checked(tmp_path):
    with pytest.raises(ValueError, match=r"reward_errors must be one of \('raise', 'skip'\)"):
        small_grpo_config(tmp_path, reward_errors="ignore")


@pytest.mark.slow
def test_a_reward_error_on_one_rank_stops_every_rank_with_the_same_message(tmp_path):
    """2 gloo processes; the reward function raises on rank 1 only. Without the guard rank 0 would hang in the
    rewards' gather; with it both ranks raise RewardFunctionError naming rank 1 and the function."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    for name in LAUNCH_VARIABLES:
        env.pop(name, None)
    script = os.path.join(REPO_ROOT, "tests", "distributed", "reward_error_ranks.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29571"]
    result = subprocess.run(
        [*command, script, str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    outcomes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for outcome in outcomes:
        assert outcome["type"] == "RewardFunctionError"
        assert "rank 1: reward function 'picky_reward' raised KeyError: 'missing answer column'" in outcome["error"]
    assert outcomes[0]["error"] == outcomes[1]["error"]


def test_ppo_masks_rows_no_reward_function_scored(default_model_dir, tmp_path):
    """A row every reward function left unscored (None) is masked out of PPO's losses, not scored 0."""
    from trlx_scale import PPOConfig, PPOTrainer

    def half_unscored(completions, **kwargs):
        return [None if index < len(completions) // 2 else float(index % 2) for index in range(len(completions))]

    args = small_grpo_config(tmp_path, PPOConfig, max_steps=1, critic_learning_rate=1e-3)
    trainer = PPOTrainer(default_model_dir, half_unscored, args, addition_dataset("train", size=16), peft_config=LORA)
    captured = {}
    finish_rollout = trainer._finish_rollout

    def capture(batch):
        result = finish_rollout(batch)
        captured["mask"] = result.completion_mask.clone()
        return result

    trainer._finish_rollout = capture
    trainer.train()
    assert logged(trainer, "ppo/unscored_rows") == [4.0]
    assert captured["mask"][:4].sum() == 0 and captured["mask"][4:].sum() > 0
    assert all(torch.isfinite(torch.tensor(v)) for v in logged(trainer, "loss"))
