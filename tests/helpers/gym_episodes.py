"""A gym-style environment for the GymRollout tests, and the checks both trainers' episodes must pass."""

from __future__ import annotations

import pytest

from trlx_scale.agents.trajectory_tokens import ObservationRenderer

ROWS = [
    {"prompt": [{"role": "user", "content": "3+4="}], "rounds": 1, "tag": "x"},
    {"prompt": [{"role": "user", "content": "12+30="}], "rounds": 3, "tag": "y"},
]
DISCOUNT = 0.5
# Every gym run's budgets (the untrained model answers in a few tokens), and the colocated engine's settings.
BUDGETS = dict(max_completion_length=96, max_turn_tokens=12, max_tool_calling_iterations=5)
COLOCATED = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=160, **BUDGETS)


class AskAgain:
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


def check_episodes(tokenizer, rows, generation, rewards) -> int:
    """Every episode of a rollout (``generation``: what TRL's ``_generate`` returned for ``rows``; ``rewards``: the
    reward columns it scored, a tensor): the loss mask is 0 exactly on the rendered observations (each the row's own tag, so reset saw
    the row) and 1 on every sampled token, the end token of the last included; the first reward column (a reward
    function of the test) counted the trajectory's messages; an episode that ended on its environment's "done"
    scored the discounted sum of its per-step rewards and the environment's own reward. Returns how many did."""
    _, completion_ids, masks, _, _, extra = generation[:6]
    trajectories, stop_reasons, rewards = extra["trajectory"], extra["stop_reason"], rewards.tolist()
    renderer = ObservationRenderer(tokenizer)
    done = 0
    for index, row in enumerate(rows):
        messages = trajectories[index]
        observation = renderer.observation_ids([{"role": "user", "content": f"again {row['tag']}"}])
        ids, mask = list(completion_ids[index]), list(masks[index])
        assert len(ids) == len(mask)
        assert mask.count(0) == len(observation) * sum(m["role"] == "user" for m in messages)
        start = 0
        while start < len(mask):
            if mask[start] == 0:
                assert ids[start : start + len(observation)] == observation
                start += len(observation)
            else:
                start += 1
        assert mask[-1] == 1
        assert rewards[index][0] == float(len(messages))
        if stop_reasons[index] == "done":
            done += 1
            assert [m["role"] for m in messages] == ["assistant", "user"] * (row["rounds"] - 1) + ["assistant"]
            assert rewards[index][1] == pytest.approx(sum(DISCOUNT**t for t in range(row["rounds"])))
            assert rewards[index][2] == float(row["rounds"])
    return done


def count_messages(prompts, completions, trajectory, **_):
    """A reward function reading the rollout's ``trajectory`` field: the number of messages after the prompt."""
    return [float(len(messages)) for messages in trajectory]
