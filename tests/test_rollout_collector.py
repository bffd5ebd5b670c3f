"""The rollout collector (trlx_scale/rollout/collector.py) builds the batch TRL's own rollout builds from the same
samples, and GRPO's advantages (rollout/group_advantages.py) are TRL's."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import trl

from trlx_scale import GRPOTrainer
from trlx_scale.rollout.batch import POLICY_VERSION_KEY
from trlx_scale.rollout.collector import RolloutCollector
from trlx_scale.rollout.group_advantages import group_advantages
from trlx_scale.tasks import addition_dataset, exact_match_reward

from .helpers.trainers import small_grpo_config


def _reward_or_none(completions, **kwargs):
    """Scores even rows only: the odd rows of a group have NaN here and the weighted sum skips it."""
    return [float(len(c)) if index % 2 == 0 else None for index, c in enumerate(completions)]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
    return a == b


# The rollout's own metrics (the engine's timings and TRL's running token count differ between two calls).
ROLLOUT_METRICS = ("rewards/", "reward", "frac_reward_zero_std", "sampling/", "completions/")


def _recorded(trainer) -> tuple[dict, dict]:
    metrics = {
        key: list(values) for key, values in trainer._metrics["train"].items() if key.startswith(ROLLOUT_METRICS)
    }
    logs = {
        key: {k: _nan_named(v) for k, v in value.items()} if isinstance(value, dict) else _nan_named(value)
        for key, value in trainer._logs.items()
    }
    return metrics, logs


def _nan_named(values) -> list:
    """NaN as a string, so that two logs with NaN in the same places compare equal."""
    return ["nan" if isinstance(v, float) and math.isnan(v) else v for v in values]


def _cleared(trainer) -> None:
    trainer._metrics["train"].clear()
    for value in trainer._logs.values():
        value.clear()


def _trainer_and_rows(default_model_dir, tmp_path, **overrides) -> tuple[GRPOTrainer, list[dict]]:
    """A colocated-engine trainer in training mode with two reward functions (one leaving odd rows unscored), and two
    prompts' rows, each ``num_generations`` times. The old-policy pass runs (``old_logprobs_from_loss_pass=False``),
    as it does in TRL's own rollout with vLLM's correction on, so that both paths compute the same keys."""
    args = small_grpo_config(
        tmp_path,
        use_vllm=True,
        old_logprobs_from_loss_pass=False,
        shared_prefix="false",
        max_completion_length=6,
        **overrides,
    )
    trainer = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=[exact_match_reward, _reward_or_none],
        args=args,
        train_dataset=addition_dataset("train", size=16),
    )
    trainer.model.train()
    dataset = addition_dataset("train", size=2)
    return trainer, [dict(dataset[index]) for index in range(2) for _ in range(args.num_generations)]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(vllm_importance_sampling_mode="token_truncate", beta=0.04, mask_truncated_completions=True),
        dict(
            vllm_importance_sampling_mode="sequence_mask",
            multi_objective_aggregation="normalize_then_sum",
            scale_rewards="batch",
        ),
    ],
    ids=["token-kl-truncated", "sequence-normalize-then-sum"],
)
def test_the_collector_builds_the_batch_trls_rollout_builds(default_model_dir, tmp_path, overrides):
    """On one trainer, at one step (the colocated engine seeds each request from the run's seed and the step, so both
    calls sample the same completions): trlx_scale's collector and TRL 1.16's ``_generate_and_score_completions``
    give the same tensors under the same keys in the same order, and log the same metrics and completion logs. The
    old-policy pass runs in both (``old_logprobs_from_loss_pass=False``), so vLLM's correction weights are compared;
    a bf16 engine beside the fp32 trainer makes them differ from 1."""
    trainer, rows = _trainer_and_rows(default_model_dir, tmp_path, vllm_dtype="auto", **overrides)
    ours = RolloutCollector(trainer).collect(copy.deepcopy(rows), policy_version=0).to_trl()
    our_records = _recorded(trainer)
    _cleared(trainer)
    theirs = trl.GRPOTrainer._generate_and_score_completions(trainer, copy.deepcopy(rows))
    their_records = _recorded(trainer)

    assert ours.pop(POLICY_VERSION_KEY).tolist() == [0] * len(rows)
    assert list(ours) == list(theirs)
    assert "importance_sampling_ratio" in ours and "old_per_token_logps" in ours
    ratio = ours["importance_sampling_ratio"]
    assert not torch.all(ratio[ratio != 0] == 1.0)  # weights that mean something
    if trainer.args.beta:
        assert "ref_per_token_logps" in ours
    for key in theirs:
        assert _same(ours[key], theirs[key]), key
    assert our_records == their_records
    assert {"reward", "rewards/_reward_or_none/mean", "sampling/importance_sampling_ratio/mean"} <= set(our_records[0])
    assert len(our_records[1]["completion"]) == len(rows)


def test_group_advantages_by_hand():
    """One group of 4, one function: rewards 1, 0, 0, 1 -> mean 0.5, std (unbiased) sqrt(1/3); the advantages are
    +-0.5 / (sqrt(1/3) + 1e-4). A row every function left unscored (NaN) has no part in the mean and advantage 0."""
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0]])
    result = group_advantages(rewards, torch.ones(1), num_generations=4)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert result.advantages.tolist() == pytest.approx([expected, -expected, -expected, expected], rel=1e-6)
    assert result.is_std_zero.tolist() == [False] * 4
    unscored = group_advantages(torch.tensor([[1.0], [0.0], [float("nan")], [1.0]]), torch.ones(1), 4)
    mean, std = 2 / 3, math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    assert unscored.advantages.tolist() == pytest.approx(
        [(1 - mean) / (std + 1e-4), -mean / (std + 1e-4), 0.0, (1 - mean) / (std + 1e-4)], rel=1e-6
    )
    assert math.isnan(unscored.rewards[2].item())
    flat = group_advantages(torch.ones(4, 1), torch.ones(1), 4, scale_rewards="none")
    assert flat.advantages.tolist() == [0.0] * 4 and flat.is_std_zero.all()
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        group_advantages(rewards, torch.ones(1), 4, scale_rewards="groups")
    with pytest.raises(ValueError, match="multi_objective_aggregation must be one of"):
        group_advantages(rewards, torch.ones(1), 4, aggregation="sum")


def test_trls_own_rollout_is_typed_with_the_rewards_it_logged(default_model_dir, tmp_path):
    """Rollouts with images run through TRL's _generate_and_score_completions whole (GRPOTrainer._trl_rollout); their
    RolloutBatch takes its rewards per function from TRL's reward log. On text rows (where both paths run) those are
    the collector's rewards, and the batches are the same."""
    trainer, rows = _trainer_and_rows(default_model_dir, tmp_path)
    collected = RolloutCollector(trainer).collect(copy.deepcopy(rows), policy_version=3)
    typed = trainer._trl_rollout(copy.deepcopy(rows), 3)
    assert typed.rewards_per_func.shape == (len(rows), 2)
    assert _same(typed.rewards_per_func, collected.rewards_per_func)
    assert torch.isnan(typed.rewards_per_func[1::2, 1]).all()  # None stays NaN through the log
    ours, theirs = collected.to_trl(), typed.to_trl()
    assert list(ours) == list(theirs)
    assert all(_same(ours[key], theirs[key]) for key in theirs)
    # Two functions of one name would share one reward log: refused by name rather than read wrongly.
    trainer.reward_func_names = ["exact_match_reward", "exact_match_reward"]
    with pytest.raises(ValueError, match="two share a name"):
        trainer._trl_rollout(copy.deepcopy(rows), 3)
