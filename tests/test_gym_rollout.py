"""Gym-style environments through TRL's rollout_func contract (agents/gym_rollout.py, trainer/gym_rollout_mixin.py):
GRPOTrainer runs the episodes on the real vLLM CPU engine, trains only the sampled tokens, resets each environment
from its dataset row, and scores the discounted per-step rewards and the environment's own reward as columns."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from trlx_scale import GRPOTrainer
from trlx_scale.agents.gym_rollout import GymRollout, discounted_return
from trlx_scale.agents.trajectory_tokens import ObservationRenderer
from trlx_scale.trainer.grpo_trainer import with_gym_reward_columns

from .helpers.trainers import small_grpo_config


class _AskAgain:
    """A user who asks ``row["rounds"]`` times: each answer earns 1, the episode ends after the last; ``get_reward``
    is the number of answers read."""

    def reset(self, prompt, **row):
        self.rounds, self.answers, self.tag = int(row["rounds"]), 0, row["tag"]
        return None  # the dataset's prompt

    def step(self, message):
        self.answers += 1
        return f"again {self.tag}", 1.0, self.answers == self.rounds, {}

    def get_reward(self):
        return float(self.answers)


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
        GymRollout(_AskAgain, turn_reward_discount=1.5)
    with pytest.raises(ValueError, match="environment_timeout"):
        GymRollout(_AskAgain, environment_timeout=0)
    gym = GymRollout(_AskAgain)
    assert [f.__name__ for f in with_gym_reward_columns(None, gym, None)] == ["_AskAgain_turns", "_AskAgain"]

    class Args:
        reward_weights = [1.0]

    with pytest.raises(ValueError, match="reward_weights has 1 entries.*give 3 weights"):
        with_gym_reward_columns(lambda **_: [], gym, Args())


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
    """Rows ask for 1 or 3 rounds: every episode that ended on its environment's "done" scored the discounted sum of
    its per-step rewards and its environment's own reward; the loss mask is 0 exactly on the rendered observations
    (each the row's own tag, so reset saw the row) and 1 on every sampled token; reward functions got the trajectory."""
    from transformers import AutoModelForCausalLM

    rows = [
        {"prompt": [{"role": "user", "content": "3+4="}], "rounds": 1, "tag": "x"},
        {"prompt": [{"role": "user", "content": "12+30="}], "rounds": 3, "tag": "y"},
    ]
    seen = {}

    def messages_read(prompts, completions, trajectory, stop_reason, **_):
        seen["trajectory"], seen["stop_reason"] = trajectory, stop_reason
        return [float(len(messages)) for messages in trajectory]

    trainer = _Recording(
        model=AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32),
        reward_funcs=messages_read,
        args=small_grpo_config(
            tmp_path,
            use_vllm=True,
            vllm_mode="colocate",
            max_steps=1,
            max_completion_length=96,
            vllm_max_model_length=160,
            max_turn_tokens=12,
            max_tool_calling_iterations=5,
        ),
        train_dataset=Dataset.from_list(rows),
        processing_class=default_tokenizer,
        rollout_func=GymRollout(_AskAgain, turn_reward_discount=0.5),
    )
    trainer.train()
    prompt_ids, completion_ids, tool_mask = trainer.recorded_generation[:3]
    rewards = trainer.recorded_rewards.tolist()
    renderer = ObservationRenderer(default_tokenizer)
    done = 0
    for index, inputs in enumerate(trainer.recorded_inputs):
        rounds, tag = inputs["rounds"], inputs["tag"]
        messages = seen["trajectory"][index]
        observation = renderer.observation_ids([{"role": "user", "content": f"again {tag}"}])
        # The mask: runs of 0 are exactly the observations, each rendered alone; everything else was sampled.
        ids, mask = completion_ids[index], tool_mask[index]
        assert len(ids) == len(mask)
        zeros = [i for i, m in enumerate(mask) if m == 0]
        assert len(zeros) == len(observation) * sum(m["role"] == "user" for m in messages)
        start = 0
        while start < len(mask):
            if mask[start] == 0:
                assert ids[start : start + len(observation)] == observation
                start += len(observation)
            else:
                start += 1
        assert mask[-1] == 1  # the last sampled token (its end token) trains
        assert rewards[index][0] == float(len(messages))
        if seen["stop_reason"][index] == "done":
            done += 1
            assert [m["role"] for m in messages] == ["assistant", "user"] * (rounds - 1) + ["assistant"]
            assert rewards[index][1] == pytest.approx(sum(0.5**t for t in range(rounds)))
            assert rewards[index][2] == float(rounds)
        assert len(prompt_ids[index]) + len(ids) <= 160
    assert done >= 4  # most episodes end on their environment (the untrained model answers in a few tokens)
    log = {key: value for entry in trainer.state.log_history for key, value in entry.items()}
    assert log["agents/turns_mean"] > 1.0 and "rewards/_AskAgain_turns/mean" in log
