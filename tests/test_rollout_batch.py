"""RolloutBatch: TRL's rollout dict, typed, and back, unchanged but for what an algorithm adds."""

import pytest
import torch
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from trlx_scale.rollout import RolloutBatch
from trlx_scale.rollout.batch import batch_policy_versions


def _trl_output(rows: int = 4) -> dict:
    # The key order of TRL 1.16's _generate_and_score_completions (its chunks are sized by the first tensor).
    return {
        "prompt_ids": torch.arange(rows * 3).view(rows, 3),
        "prompt_mask": torch.ones(rows, 3, dtype=torch.long),
        "completion_ids": torch.arange(rows * 2).view(rows, 2),
        "completion_mask": torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]])[:rows],
        "advantages": torch.linspace(-1, 1, rows),
        "num_items_in_batch": torch.tensor(6),
        "old_per_token_logps": None,
        "tool_mask": torch.tensor([[1, 0], [1, 1], [1, 1], [1, 1]])[:rows],
    }


def test_round_trip_keeps_trl_keys_in_order_and_tags_every_row():
    output = _trl_output()
    rewards = torch.arange(8.0).view(8, 1)  # two processes' rows
    batch = RolloutBatch.from_trl(output, rewards_per_func=rewards, policy_version=3, process_index=1)
    assert batch.num_rows == 4 and torch.equal(batch.local_rewards_per_func, rewards[4:])
    assert torch.equal(batch.loss_mask, output["completion_mask"] * output["tool_mask"])
    trl = batch.to_trl()
    assert list(trl)[:-1] == list(output)  # TRL's order, None values included; then the version
    for key, value in output.items():
        assert (trl[key] is None and value is None) or torch.equal(trl[key], value), key
    assert torch.equal(batch_policy_versions(trl), torch.full((4,), 3))
    # What an algorithm adds (PPO's returns and values) joins at the end; the version survives TRL's splits.
    batch.returns = batch.old_values = torch.zeros(4, 2)
    trl = batch.to_trl()
    assert list(trl)[-3:] == ["old_values", "returns", "policy_version"]
    chunks = split_tensor_dict(shuffle_sequence_dict(trl), 2)
    assert all(torch.equal(chunk["policy_version"], torch.full((2,), 3)) for chunk in chunks)


def test_rows_must_agree_and_the_layout_must_be_known():
    output = _trl_output()
    output["advantages"] = torch.zeros(3)
    with pytest.raises(ValueError, match="advantages has 3 rows, completion_ids 4"):
        RolloutBatch.from_trl(output, rewards_per_func=torch.zeros(4, 1), policy_version=0, process_index=0)
    good = _trl_output()
    with pytest.raises(ValueError, match="layout must be one of"):
        RolloutBatch(
            **{k: good[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")},
            rewards_per_func=torch.zeros(4, 1),
            policy_version=0,
            layout="ragged",
        )
