"""Reasoning Gym's tasks as multi-turn tool environments for ``GRPOTrainer(environment_factory=...)``.

`Reasoning Gym <https://github.com/open-thought/reasoning-gym>`_ (``pip install 'trlx-scale[agents]'``) generates
verifiable problems procedurally (arithmetic, logic, games, ...) and scores an answer with each task's own
``score_answer``. Here a task becomes TRL's environment contract, so it runs through the trainer's tool loop:

- ``reasoning_gym_dataset(task, size, seed, **config)``: the rows to train on, one per problem (``prompt``: the
  problem as a user message; ``task``, ``size``, ``seed``, ``config``, ``index``: where the problem comes from);
- ``ReasoningGymEnvironment``: ``reset(**row)`` picks the row's problem; its one tool, ``submit(answer)``, scores the
  answer with the task's ``score_answer`` and tells the model whether it was right, so a wrong answer can be
  corrected on the next turn (up to ``max_tool_calling_iterations``); ``get_reward()`` is the best score submitted,
  0 when nothing was.

The datasets are rebuilt from (task, size, seed, config) and cached per process: a row carries only where its
problem comes from, so rows pass between ranks and processes as plain data.
"""

from __future__ import annotations

import functools
import json
from typing import Any


@functools.lru_cache(maxsize=16)
def _task_dataset(task: str, size: int, seed: int, config_json: str) -> Any:
    try:
        import reasoning_gym
    except ImportError as error:  # an optional dependency
        raise ImportError(
            "ReasoningGymEnvironment needs Reasoning Gym: `pip install 'trlx-scale[agents]'`."
        ) from error
    return reasoning_gym.create_dataset(task, size=size, seed=seed, **json.loads(config_json))


def reasoning_gym_dataset(task: str, size: int, seed: int = 0, **config: Any) -> list[dict[str, Any]]:
    """One row per problem of Reasoning Gym's ``task`` (``config``: the task's own options), for
    ``datasets.Dataset.from_list``."""
    config_json = json.dumps(config, sort_keys=True)
    dataset = _task_dataset(task, size, seed, config_json)
    return [
        {
            "prompt": [{"role": "user", "content": entry["question"]}],
            "task": task,
            "size": size,
            "seed": seed,
            "config": config_json,
            "index": index,
        }
        for index, entry in enumerate(dataset)
    ]


class ReasoningGymEnvironment:
    """TRL's ``environment_factory`` contract over a Reasoning Gym problem (see the module docstring)."""

    def reset(self, **row: Any) -> None:
        self._dataset = _task_dataset(row["task"], int(row["size"]), int(row["seed"]), row["config"])
        self._entry = self._dataset[int(row["index"])]
        self.best_score = 0.0
        self.submissions = 0
        return None  # the problem is already the prompt

    def submit(self, answer: str) -> str:
        """Submit an answer to the problem; the reply says whether it is right.

        Args:
            answer: The answer, as text.
        """
        self.submissions += 1
        score = float(self._dataset.score_answer(str(answer), self._entry))
        self.best_score = max(self.best_score, score)
        return "correct" if score >= 1.0 else "incorrect, try again"

    def get_reward(self) -> float:
        return self.best_score
