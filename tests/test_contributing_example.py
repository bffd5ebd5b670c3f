"""docs/contributing.md's worked example (RLOO as one folder: a pure function, a config, a trainer of one override),
written from the doc itself into a package and imported, so the doc and the code cannot drift apart; and the trainer
it builds has every trlx_scale feature."""

import dataclasses
import importlib
import json
import math
import os
import re
import sys

import torch

from trlx_scale.rollout import RolloutBatch

from .helpers.launch import REPO_ROOT
from .helpers.trainers import small_grpo_config

RLOO_FILES = ("advantages.py", "config.py", "trainer.py")


def _rloo_package(tmp_path):
    """The guide's three blocks, each written to the file it names, as the package ``rloo`` (imported afresh)."""
    with open(os.path.join(REPO_ROOT, "docs", "contributing.md")) as handle:
        text = handle.read()
    section = text[text.index("## Worked example: RLOO") :]
    blocks = re.findall(r"`trlx_scale/rloo/(\w+\.py)`[^`]*?```python\n(.*?)```", section, re.S)
    assert tuple(name for name, _ in blocks) == RLOO_FILES
    package = tmp_path / "plugin" / "rloo"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name, code in blocks:
        (package / name).write_text(code)
    sys.path.insert(0, str(package.parent))
    try:
        for name in [m for m in sys.modules if m == "rloo" or m.startswith("rloo.")]:
            del sys.modules[name]
        return {name[:-3]: importlib.import_module(f"rloo.{name[:-3]}") for name in RLOO_FILES}
    finally:
        sys.path.remove(str(package.parent))


def _batch(rewards: torch.Tensor) -> RolloutBatch:
    rows = rewards.size(0)
    return RolloutBatch(
        prompt_ids=torch.zeros(rows, 2, dtype=torch.long),
        prompt_mask=torch.ones(rows, 2, dtype=torch.long),
        completion_ids=torch.zeros(rows, 3, dtype=torch.long),
        completion_mask=torch.ones(rows, 3, dtype=torch.long),
        advantages=torch.zeros(rows),
        rewards_per_func=rewards,
        policy_version=0,
    )


def test_rloo_from_the_contributing_guide_scores_leave_one_out_trains_and_has_every_feature(
    default_model_dir, tmp_path, fake_hub
):
    from trlx_scale.tasks import addition_dataset, exact_match_reward

    rloo = _rloo_package(tmp_path)
    # The pure function, by hand: one group of 4 with rewards (1, 0, 0, 1): A_i = r_i - mean of the other three,
    # = (1 - 1/3, 0 - 2/3, 0 - 2/3, 1 - 1/3); whitened, the two values keep their signs and the batch's mean is 0.
    leave_one_out = rloo["advantages"].leave_one_out_advantages
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert torch.allclose(leave_one_out(rewards, 4), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    whitened = leave_one_out(rewards, 4, normalize=True)
    assert abs(float(whitened.mean())) < 1e-6 and (whitened > 0).tolist() == [True, False, False, True]

    config_cls = rloo["config"].RLOOConfig
    field = next(f for f in dataclasses.fields(config_cls) if f.name == "normalize_advantages")
    assert field.default is False and "help" in field.metadata
    args = small_grpo_config(
        tmp_path,
        config_cls,
        use_vllm=True,
        vllm_dtype="trainer",
        max_steps=2,
        save_steps=2,
        save_strategy="steps",
        hub_model_id="tester/rloo-run",
        hub_push_backoff_s=0.01,
    )
    trainer = rloo["trainer"].RLOOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=addition_dataset("train", size=32),
    )
    trainer.model.train()
    scored = trainer._finish_rollout(_batch(torch.tensor([[1.0], [0.0], [0.0], [1.0]])))
    assert torch.allclose(scored.advantages, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))

    seen = []
    original = trainer._finish_rollout

    def recording(batch):
        result = original(batch)
        seen.append((batch.rewards_per_func.clone(), result.advantages.clone(), result.policy_version))
        return result

    trainer._finish_rollout = recording
    trainer.train()
    assert trainer.state.global_step == 2 and seen
    for rewards_per_func, advantages, _ in seen:
        groups = rewards_per_func.sum(dim=1).view(-1, 4).tolist()
        expected = [r - (sum(g) - r) / 3 for g in groups for r in g]
        assert torch.allclose(advantages, torch.tensor(expected, dtype=advantages.dtype), atol=1e-6)
    # Each rollout is tagged with the policy version that generated it: 0, then 1 after the first update.
    assert [version for _, _, version in seen] == [0, 1]
    history = trainer.state.log_history
    assert all(math.isfinite(e["loss"]) for e in history if "loss" in e)

    # The features the doc promises, each seen in what it produces.
    train_logs = [e for e in history if "loss" in e]
    assert any(key.startswith("time/") for key in train_logs[0]), "profiler"
    assert all("reliability/skipped_steps" in e for e in train_logs), "non-finite guard"
    assert "memory/planned_peak_gib" in train_logs[0], "planned memory"
    checkpoint = tmp_path / "checkpoint-2"
    marker = json.loads((checkpoint / "trlx_scale_checkpoint_complete.json").read_text())
    assert marker["global_step"] == 2 and marker["files"], "atomic checkpoints"
    assert json.loads((checkpoint / "policy_version.json").read_text()) == {"policy_version": 2}
    trainer.push_to_hub()
    files = fake_hub.repos["tester/rloo-run"]
    assert "README.md" in files and "rloo" in files["README.md"].decode()  # the trainer's tag on the card
    assert not any(b"hf_fake_token" in body for body in fake_hub.received), "Hub push, scanned"
