"""DAPO's soft overlong punishment (grpo.overlong_penalty): TRL's formula, scaled, as a reward column of its own."""

from __future__ import annotations

import pytest
from trl.rewards import get_soft_overlong_punishment

from trlx_scale import GRPOTrainer
from trlx_scale.grpo.overlong_penalty import OverlongPenalty
from trlx_scale.tasks import addition_dataset, exact_match_reward

from .helpers.trainers import small_grpo_config


def test_the_penalty_is_trls_soft_overlong_punishment_scaled_by_its_factor():
    lengths = [0, 5, 6, 7, 8, 9, 10, 11]
    ids = [[1] * length for length in lengths]
    trls = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)(ids)
    assert OverlongPenalty(10, 4)(ids) == pytest.approx(trls)
    assert OverlongPenalty(10, 4, factor=0.5)(ids) == pytest.approx([0.5 * value for value in trls])
    assert OverlongPenalty(10, 4)(ids)[:3] == [0.0, 0.0, 0.0] and OverlongPenalty(10, 4)(ids)[-2:] == [-1.0, -1.0]


def test_the_trainer_scores_it_as_a_column_of_its_own_with_weight_one(tmp_path, default_model_dir):
    """A column 'overlong_penalty' after the user's functions, its weight appended to the user's reward_weights on the
    trainer's config only, and logged with the rest."""
    args = small_grpo_config(
        tmp_path, max_completion_length=5, overlong_buffer_length=5, reward_weights=[2.0], max_steps=1
    )
    trainer = GRPOTrainer(default_model_dir, exact_match_reward, args, train_dataset=addition_dataset("train", size=8))
    assert trainer.reward_func_names == ["exact_match_reward", "overlong_penalty"]
    assert trainer.reward_weights.tolist() == [2.0, 1.0] and args.reward_weights == [2.0]
    trainer.train()
    (log,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    # The ramp spans the whole budget (5 of 5 tokens): every completion (at least its end token) loses -length/5.
    assert log["rewards/overlong_penalty/mean"] == pytest.approx(-log["completions/mean_length"] / 5, abs=1e-6)


def test_bad_settings_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"overlong_buffer_length must be between 1 and max_completion_length \(5\)"):
        small_grpo_config(tmp_path, max_completion_length=5, overlong_buffer_length=6)
    with pytest.raises(ValueError, match="overlong_penalty_factor must be a positive finite reward"):
        small_grpo_config(tmp_path, overlong_buffer_length=2, overlong_penalty_factor=0.0)


def test_in_a_multi_turn_trajectory_the_length_is_the_one_the_tool_loop_budgets(
    tmp_path, default_model_dir, default_tokenizer
):
    """With tools, the penalty reads the whole trajectory after the prompt (sampled and tool tokens), the length TRL's
    max_completion_length budget counts: with the ramp over the whole budget, each trajectory loses its length / 180."""
    from trlx_scale.tasks.tool_chat_template import with_tool_template

    from .helpers.inc_tool_calls import EVERY_TURN_CALLS_INC, inc, inc_dataset, length_reward

    class Recording(GRPOTrainer):
        def _tool_call_loop(self, *args):
            self.recorded_loop = super()._tool_call_loop(*args)
            return self.recorded_loop

    budget = EVERY_TURN_CALLS_INC["max_completion_length"]
    args = small_grpo_config(tmp_path, **EVERY_TURN_CALLS_INC, overlong_buffer_length=budget)
    trainer = Recording(
        model=default_model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=inc_dataset(2),
        processing_class=with_tool_template(default_tokenizer),
        tools=[inc],
    )
    trainer.train()
    tool_mask, _, completion_ids, *_ = trainer.recorded_loop
    assert any(0 in mask for mask in tool_mask)  # the trajectories hold tool tokens
    expected = -sum(len(ids) for ids in completion_ids) / len(completion_ids) / budget
    (log,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert log["rewards/overlong_penalty/mean"] == pytest.approx(expected, abs=1e-6)
