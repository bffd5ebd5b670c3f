"""Dealing a scored rollout's samples to the ranks by cost (``balance_ranks``, ``rollout.rank_balance``): the
assignment, the refusals, and the exchange between 2 gloo processes. The 2-process GRPO runs that train with it
(DDP and ZeRO-3, the same losses and gradient norms as TRL's placement) are in tests/test_packing_distributed.py."""

from __future__ import annotations

import pytest

from trlx_scale.passes.micro_batch_plan import sample_cost
from trlx_scale.rollout.rank_balance import (
    balanced_rank_assignment,
    rank_balance_blocker,
    rank_costs,
    unmovable_rollout_reason,
)

from .helpers.launch import run_torchrun_report
from .helpers.trainers import small_grpo_config


def _imbalance(costs):
    return max(costs) / (sum(costs) / len(costs))


def test_every_rank_keeps_its_count_and_the_costs_even_out():
    # TRL's placement: the long samples happen to sit on rank 0.
    lengths = [400, 350, 380, 300, 20, 25, 30, 40, 60, 45, 35, 50]
    placed = [list(range(r * 4, (r + 1) * 4)) for r in range(3)]
    assignment = balanced_rank_assignment(lengths, num_ranks=3, coefficient=100.0)
    assert sorted(i for rank in assignment for i in rank) == list(range(12))  # every sample exactly once
    assert [len(rank) for rank in assignment] == [4, 4, 4]  # TRL's split and counts unchanged
    before = _imbalance(rank_costs(lengths, placed, 100.0))
    after = _imbalance(rank_costs(lengths, assignment, 100.0))
    assert before > 2.5 and after < 1.25
    # No assignment can beat the longest sample's share: it is within 4/3 of the best possible (LPT).
    costs = [sample_cost(length, 100.0) for length in lengths]
    assert after <= max(4 / 3, max(costs) / (sum(costs) / 3)) + 1e-9
    assert assignment == balanced_rank_assignment(list(lengths), 3, 100.0)  # deterministic on every rank


def test_groups_move_whole_and_bad_shapes_are_refused():
    lengths = [100, 110, 90, 95, 10, 12, 11, 9, 50, 52, 49, 51, 30, 33, 31, 29]
    assignment = balanced_rank_assignment(lengths, num_ranks=2, coefficient=10.0, unit_size=4)
    # The heaviest group (0) alone on one rank with the lightest (1): the other rank takes groups 2 and 3.
    assert assignment == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
    shuffled = lengths[8:] + lengths[:8]  # the same groups, placed the other way round
    heavy_first = balanced_rank_assignment(shuffled, num_ranks=2, coefficient=10.0, unit_size=4)
    assert heavy_first == [list(range(8, 16)), list(range(8))]  # groups 0 and 1 again together, now at 8-15
    with pytest.raises(ValueError, match="evenly to 3 ranks"):
        balanced_rank_assignment(lengths, num_ranks=3, coefficient=1.0)
    with pytest.raises(ValueError, match="units of 3"):
        balanced_rank_assignment(lengths, num_ranks=2, coefficient=1.0, unit_size=3)


def test_the_move_is_refused_where_it_would_change_the_loss():
    for loss_type in ("grpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"):
        assert rank_balance_blocker(loss_type, 1.0) is None
    assert rank_balance_blocker("dapo", 1.0, gradient_accumulation_steps=8, steps_per_generation=4) is None
    assert "each micro-batch's token count" in rank_balance_blocker("bnpo", 1.0)
    assert "top_entropy_quantile" in rank_balance_blocker("grpo", 0.2)
    assert "entropy bonus" in rank_balance_blocker("dapo", 1.0, entropy_bonus=True)
    assert "load-balancing loss" in rank_balance_blocker("dapo", 1.0, router_aux_loss=True)
    partial = rank_balance_blocker("dapo", 1.0, gradient_accumulation_steps=2, steps_per_generation=4)
    assert "part of a rank's generation batch" in partial
    assert unmovable_rollout_reason(["prompt_ids", "completion_ids"]) is None
    assert "image inputs (pixel_values)" in unmovable_rollout_reason(["prompt_ids", "pixel_values"])


def test_the_setting_is_checked(tmp_path):
    assert small_grpo_config(tmp_path, balance_ranks=True).balance_ranks == "true"
    with pytest.raises(ValueError, match="balance_ranks must be"):
        small_grpo_config(tmp_path, balance_ranks="sometimes")


@pytest.mark.distributed
def test_two_processes_exchange_rows_and_keep_every_value(tmp_path):
    report = run_torchrun_report("rank_balance_exchange.py", tmp_path / "report.json", port=29661)
    ranks = report["ranks"]
    assert sorted(i for rank in ranks for i in rank["kept"]) == list(range(8))
    assert any(any(i // 4 != rank["rank"] for i in rank["kept"]) for rank in ranks)  # samples did move
    for rank in ranks:
        assert rank["same_samples"], rank  # tokens, log-probs, masks, advantages, ratios, versions
        assert rank["prompt_width"] == rank["widest_prompt"]  # trimmed to what the kept rows use
        assert rank["completion_width"] == rank["logps_width"] == rank["widest_completion"]
        assert rank["weight_shape"] == [4, 1]  # a one-column value is not padded to the completion
        assert rank["ratio_width"] == rank["widest_completion"]
        assert rank["ratio_padding_is_one"]  # TRL's exp(0) at the padding (VESPO reads it unmasked)
        assert rank["tool_mask_dtype"] == "torch.bool"
        assert rank["num_items_in_batch"] == 123.0  # a global value stays as it is
        assert rank["prompt_left_padded"]


@pytest.mark.distributed
def test_two_processes_train_the_same_with_the_samples_dealt_by_cost(tmp_path):
    """GRPO on 2 gloo processes (colocated engine, packed rows, prompts of 1x and 10x length): dealing the samples
    moved some of them and left the rewards, losses and gradient norms of TRL's placement, up to float rounding."""
    placed = run_torchrun_report("rank_balance_training.py", tmp_path / "placed.json", 29662, ["false", "dapo"])
    dealt = run_torchrun_report("rank_balance_training.py", tmp_path / "dealt.json", 29663, ["true", "dapo"])
    assert len(placed["steps"]) == len(dealt["steps"]) == 3
    moved = [
        step["batch/rank_imbalance_after_balance"] < step["batch/rank_imbalance_before_balance"]
        for step in dealt["steps"]
    ]
    assert any(moved), dealt["steps"]  # the deal had something to move, and moved it
    for plain, ours in zip(placed["steps"], dealt["steps"], strict=True):
        assert "batch/rank_imbalance_after_balance" not in plain
        assert ours["reward"] == plain["reward"]  # the same rollouts (scored before the deal)
        # TRL logs the entropy as a token mean over every rank's tokens: it does not move with the samples either.
        for key in ("loss", "grad_norm", "entropy"):
            assert ours[key] == pytest.approx(plain[key], rel=1e-3, abs=1e-6), key
