"""docs/contributing.md's worked example (RLOO through the `_score_rollout` seam), run from the doc itself, so the
doc and the code cannot drift apart."""

import math
import os
import re

import torch

from .helpers.launch import REPO_ROOT
from .helpers.trainers import small_grpo_config


def _rloo_trainer_class():
    with open(os.path.join(REPO_ROOT, "docs", "contributing.md")) as handle:
        text = handle.read()
    section = text[text.index("## Worked example: RLOO") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "docs/contributing.md", "exec"), namespace)
    return namespace["RLOOTrainer"]


def test_rloo_from_the_contributing_guide_scores_leave_one_out_and_trains(default_model_dir, tmp_path):
    from trlx_scale.tasks import addition_dataset, exact_match_reward

    rloo = _rloo_trainer_class()
    trainer = rloo(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=small_grpo_config(tmp_path, use_vllm=True, vllm_dtype="trainer", max_steps=2),
        train_dataset=addition_dataset("train", size=32),
    )
    # By hand, one group of 4 with rewards (1, 0, 0, 1): A_i = r_i - mean of the other three,
    # = (1 - 1/3, 0 - 2/3, 0 - 2/3, 1 - 1/3).
    trainer.model.train()
    output = {"completion_ids": torch.zeros(4, 3, dtype=torch.long), "advantages": torch.zeros(4)}
    scored = trainer._score_rollout(output, torch.tensor([[1.0], [0.0], [0.0], [1.0]]))
    assert torch.allclose(scored["advantages"], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))

    seen = []
    original = trainer._score_rollout

    def recording(output, rewards_per_func):
        result = original(output, rewards_per_func)
        seen.append((rewards_per_func.clone(), result["advantages"].clone()))
        return result

    trainer._score_rollout = recording
    trainer.train()
    assert trainer.state.global_step == 2 and seen
    for rewards_per_func, advantages in seen:
        groups = rewards_per_func.sum(dim=1).view(-1, 4).tolist()
        expected = [r - (sum(g) - r) / 3 for g in groups for r in g]
        assert torch.allclose(advantages, torch.tensor(expected, dtype=advantages.dtype), atol=1e-6)
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)
