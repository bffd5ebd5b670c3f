"""pass@k of binary rewards over groups, against values worked out by hand."""

import math

import pytest
import torch

from trlx_scale.rollout.pass_at_k import group_pass_at_k, is_binary, pass_at_k


def test_pass_at_k_matches_the_hand_worked_estimates():
    # n=4, c=1: pass@1 = 1 - C(3,1)/C(4,1) = 1 - 3/4 = 0.25; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5;
    # pass@4 = 1 - C(3,4)/C(4,4) = 1 (one correct among all four).
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7.
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(4, 0, 4) == 0.0
    with pytest.raises(ValueError, match="1 <= k <= the group's size"):
        pass_at_k(4, 1, 5)


def test_group_pass_at_k_averages_over_groups():
    # Group 1: one correct of four -> pass@1 0.25, pass@4 1. Group 2: none -> 0, 0. Group 3: all -> 1, 1.
    rewards = torch.tensor([0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.float32)
    result = group_pass_at_k(rewards, 4, (1, 4))
    assert result[1] == pytest.approx((0.25 + 0 + 1) / 3)
    assert result[4] == pytest.approx(2 / 3)
    # An unscored completion (NaN) leaves a group of three: pass@4 cannot be estimated for it.
    with_nan = torch.tensor([math.nan, 1, 0, 0, 1, 1, 1, 1])
    assert group_pass_at_k(with_nan, 4, (1, 4)) == pytest.approx({1: (1 / 3 + 1) / 2, 4: 1.0})


def test_only_zero_one_rewards_are_binary():
    assert is_binary(torch.tensor([0.0, 1.0, math.nan]))
    assert not is_binary(torch.tensor([0.0, 0.5]))
    assert not is_binary(torch.tensor([math.nan]))
