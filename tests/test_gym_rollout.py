"""Gym-style environments through TRL's rollout_func contract (agents/gym_rollout.py, agents/colocated_gym_rollout.py):
GRPOTrainer runs the episodes on the real vLLM CPU engine, trains only the sampled tokens, resets each environment
from its dataset row, and scores the discounted per-step rewards and the environment's own reward as columns.
(AsyncGRPOTrainer's side is in tests/test_async_grpo.py, beside the module's server.)"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from trlx_scale import GRPOTrainer
from trlx_scale.agents.gym_rollout import GymRollout, discounted_return

from .helpers.gym_episodes import COLOCATED, DISCOUNT, ROWS, AskAgain, check_episodes, count_messages
from .helpers.trainers import small_grpo_config


def test_discounted_return_counts_steps_without_a_reward_as_zero():
    assert discounted_return([1.0, None, 2.0], 0.5) == pytest.approx(1.0 + 0.0 + 0.25 * 2.0)
    assert discounted_return([1.0, 1.0, 1.0], 1.0) == 3.0
    assert discounted_return([None, None], 0.9) is None
    assert discounted_return([], 0.9) is None


def test_bad_settings_are_refused_by_name():
    class NoStep:
        def reset(self, prompt, **row):
            return None

    with pytest.raises(TypeError, match="needs a callable `step`"):
        GymRollout(NoStep)
    with pytest.raises(ValueError, match="turn_reward_discount"):
        GymRollout(AskAgain, turn_reward_discount=1.5)
    with pytest.raises(ValueError, match="environment_timeout"):
        GymRollout(AskAgain, environment_timeout=0)
    gym = GymRollout(AskAgain)
    assert [f.__name__ for f in gym.after_reward_funcs(None, None)] == ["AskAgain_turns", "AskAgain"]

    class Args:
        reward_weights = [1.0]

    with pytest.raises(ValueError, match="reward_weights has 1 entries.*give 3 weights"):
        gym.after_reward_funcs(count_messages, Args())


class _Recording(GRPOTrainer):
    """Keeps the rollout TRL scored and its reward columns (a test's subclass: the trainer's code runs unchanged)."""

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self.recorded_rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.recorded_inputs = inputs
        return self.recorded_rewards

    def _generate(self, prompts):
        self.recorded_generation = super()._generate(prompts)
        return self.recorded_generation


def test_gym_episodes_train_through_grpo_on_the_colocated_engine(tmp_path, default_model_dir, default_tokenizer):
    """Rows ask for 1 or 3 rounds: see helpers/gym_episodes.check_episodes for what every episode must satisfy."""
    from transformers import AutoModelForCausalLM

    trainer = _Recording(
        model=AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32),
        reward_funcs=count_messages,
        args=small_grpo_config(tmp_path, max_steps=1, **COLOCATED),
        train_dataset=Dataset.from_list(ROWS),
        processing_class=default_tokenizer,
        rollout_func=GymRollout(AskAgain, turn_reward_discount=DISCOUNT),
    )
    trainer.train()
    prompt_ids, completion_ids = trainer.recorded_generation[:2]
    done = check_episodes(
        default_tokenizer, trainer.recorded_inputs, trainer.recorded_generation, trainer.recorded_rewards
    )
    assert done >= 4  # most episodes end on their environment (the untrained model answers in a few tokens)
    assert all(len(p) + len(c) <= 160 for p, c in zip(prompt_ids, completion_ids, strict=True))
    log = {key: value for entry in trainer.state.log_history for key, value in entry.items()}
    assert log["agents/turns_mean"] > 1.0 and "rewards/AskAgain_turns/mean" in log


def test_gym_rollout_with_tools_is_refused(tmp_path, default_model_dir, default_tokenizer):
    with pytest.raises(ValueError, match="pass one or the other"):
        GRPOTrainer(
            model=default_model_dir,
            reward_funcs=count_messages,
            args=small_grpo_config(tmp_path),
            train_dataset=Dataset.from_list(ROWS),
            processing_class=default_tokenizer,
            tools=[len],
            rollout_func=GymRollout(AskAgain),
        )


def test_gym_rollout_on_rows_with_images_is_refused(tmp_path, default_model_dir, default_tokenizer):
    """Rows with images take TRL's own rollout, whose rollout_func gets the prompts without their rows; GymRollout's
    episodes are text and would drop the images: refused by name before anything is sampled."""
    trainer = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=count_messages,
        args=small_grpo_config(tmp_path),
        train_dataset=Dataset.from_list(ROWS),
        processing_class=default_tokenizer,
        rollout_func=GymRollout(AskAgain),
    )
    with pytest.raises(ValueError, match="runs text episodes, and this batch has images"):
        trainer._generate_and_score_completions([{**ROWS[0], "image": None}])
