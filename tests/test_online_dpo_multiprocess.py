"""Online DPO on several processes: equal numbers of pairs per rank (tie pairs top up the short ranks), and a gradient
that is exactly the mean over the step's real pairs. The example itself on 2 processes, under DDP and ZeRO-3, trains
exactly as on one (tests/test_process_count_equivalence.py), and learns on one (tests/test_dpo_example.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trlx_scale.dpo.online_pair_balance import balance_pairs, check_multi_process_online_loss


def _pair(i: int) -> dict:
    return {"prompt_ids": [1, i], "chosen_ids": [10 + i], "rejected_ids": [20 + i]}


def test_pairs_are_split_in_rank_order_and_topped_up_with_ties():
    pairs = [_pair(i) for i in range(5)]
    rank0, rank1 = balance_pairs(pairs, 0, 2), balance_pairs(pairs, 1, 2)
    assert [p["prompt_ids"][1] for p in rank0.pairs] == [0, 1, 2] and rank0.padding == 0
    assert [p["prompt_ids"][1] for p in rank1.pairs] == [3, 4, 3] and rank1.padding == 1
    tie = rank1.pairs[-1]
    assert tie["chosen_ids"] == tie["rejected_ids"] == [13]
    assert rank0.loss_scale == rank1.loss_scale == pytest.approx(2 * 3 / 5)
    assert rank0.total_padding == rank1.total_padding == 1
    # A rank left without real pairs still trains on ties (every rank runs the same collectives).
    lonely = balance_pairs([_pair(0)], 1, 2)
    assert len(lonely.pairs) == 1 and lonely.padding == 1
    assert balance_pairs([], 0, 2).pairs == []


def test_balanced_gradient_equals_the_mean_over_real_pairs():
    """The DPO sigmoid loss on a toy linear scorer: ranks' scaled means, averaged as DDP does, give the gradient of
    the plain mean over the real pairs (the tie pairs add nothing)."""
    torch.manual_seed(0)
    features = {i: torch.randn(4) for i in range(40)}
    weight = torch.randn(4, requires_grad=True)

    def pair_loss(pair):
        chosen = features[pair["chosen_ids"][0]] @ weight
        rejected = features[pair["rejected_ids"][0]] @ weight
        return -F.logsigmoid(0.1 * (chosen - rejected))

    pairs = [_pair(i) for i in range(7)]
    expected = torch.autograd.grad(torch.stack([pair_loss(p) for p in pairs]).mean(), weight)[0]
    world = 3
    grads = []
    for rank in range(world):
        share = balance_pairs(pairs, rank, world)
        loss = torch.stack([pair_loss(p) for p in share.pairs]).mean() * share.loss_scale
        grads.append(torch.autograd.grad(loss, weight)[0])
    torch.testing.assert_close(torch.stack(grads).mean(0), expected)


def test_losses_a_tie_pair_would_bias_are_refused():
    check_multi_process_online_loss(["sigmoid", "ipo"], use_weighting=False)
    with pytest.raises(ValueError, match=r"exact only for loss_type in \('sigmoid', 'hinge', 'ipo'\); got \['sft'\]"):
        check_multi_process_online_loss(["sigmoid", "sft"], use_weighting=False)
    with pytest.raises(ValueError, match="cannot use use_weighting=True"):
        check_multi_process_online_loss(["sigmoid"], use_weighting=True)
