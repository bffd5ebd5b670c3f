"""The per-turn prefix check of the concurrent tool loop (agents/tool_call_continuation.py): before each later turn the
held ids are checked against the template's rendering; "keep" counts a mismatch and trains the sampled tokens,
"discard" ends the trajectory there and masks it out of the loss, "off" renders nothing."""

from __future__ import annotations

import asyncio

import pytest

from trlx_scale.agents.multi_turn_rollout import SampledTurn
from trlx_scale.agents.tool_call_continuation import (
    ContinuationLimits,
    TrajectoryRules,
    TrajectoryState,
    continue_trajectories,
)
from trlx_scale.agents.tool_runner import ToolRunner, ToolStats

END = 2


class _TwoCallsThenAnswer:
    """Each trajectory's turn 1 calls the tool again; turn 2 answers."""

    async def sample(self, prompt_ids, max_tokens, seed, turn):
        return SampledTurn(ids=[10, END] if turn < 2 else [11, END], logprobs=[-0.5, -0.5], finish_reason="stop")


def _parse(ids, held, tools):
    if ids[0] == 10:
        return {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    return {"role": "assistant", "content": "done"}


def _run(policy: str, checked: list):
    def mismatch_at(conversation, held, tools):
        checked.append(len(held))
        return 3 if held[0] == 8 else None  # trajectory 1's prompt starts with 8: its rendering differs at 3

    states = [
        TrajectoryState(
            prompt=[{"role": "user", "content": "q"}],
            prompt_ids=[first, 1],
            completion_ids=[10, END],
            completion=[_parse([10], [], None)],
            logprobs=[-0.5, -0.5],
            tool_mask=[1, 1],
        )
        for first in (7, 8)
    ]
    runners = [ToolRunner({"f": lambda: "r"}, timeout=5) for _ in states]
    return asyncio.run(
        continue_trajectories(
            states,
            runners,
            [0, 1],
            sampler=_TwoCallsThenAnswer(),
            rules=TrajectoryRules(
                limits=ContinuationLimits(max_completion_length=64, max_model_len=256, max_tool_calling_iterations=4),
                parse=_parse,
                suffix_ids=lambda messages: [5, 6],
                prefix_mismatch_at=mismatch_at,
                prefix_mismatch=policy,
            ),
            stats=ToolStats(),
        )
    )


def test_keep_counts_each_mismatched_turn_and_trains_what_was_sampled():
    checked: list = []
    clean, mismatched = _run("keep", checked)
    assert (clean.prefix_mismatches, mismatched.prefix_mismatches) == (0, 2)  # checked before both later turns
    assert mismatched.completion_ids == clean.completion_ids == [10, END, 5, 6, 10, END, 5, 6, 11, END]
    assert mismatched.tool_mask == [1, 1, 0, 0, 1, 1, 0, 0, 1, 1] and mismatched.stop_reason == "done"
    assert len(checked) == 4


def test_discard_ends_the_trajectory_at_the_mismatch_and_masks_it_out_of_the_loss():
    clean, mismatched = _run("discard", [])
    assert clean.stop_reason == "done" and not clean.discarded and 1 in clean.tool_mask
    assert mismatched.discarded and mismatched.stop_reason == "prefix_mismatch"
    assert mismatched.completion_ids == [10, END] and mismatched.tool_mask == [0, 0]  # its tool results rolled back
    assert [message["role"] for message in mismatched.completion] == ["assistant"]


def test_off_renders_nothing():
    checked: list = []
    _, mismatched = _run("off", checked)
    assert checked == [] and mismatched.prefix_mismatches == 0


def test_the_policy_is_checked_by_name(tmp_path):
    from .helpers.trainers import small_grpo_config

    with pytest.raises(ValueError, match="prefix_mismatch must be one of \\('keep', 'discard', 'off'\\)"):
        small_grpo_config(tmp_path, prefix_mismatch="realign")


class _ReloadInsideTurnTwo:
    """Turn 1 sampled by version 0; a reload (version 1) lands after the first token of turn 2."""

    async def sample(self, prompt_ids, max_tokens, seed, turn):
        ids = [10, END] if turn < 2 else [11, END]
        versions = [0, 0] if turn < 2 else [0, 1]
        return SampledTurn(ids, [-0.5, -0.5], "stop", version=min(versions), token_versions=versions)


def _versioned_run(first_versions):
    state = TrajectoryState(
        prompt=[{"role": "user", "content": "q"}],
        prompt_ids=[7, 1],
        completion_ids=[10, END],
        completion=[_parse([10], [], None)],
        logprobs=[-0.5, -0.5],
        tool_mask=[1, 1],
        turn_versions=[0],
        token_versions=first_versions,
    )
    (done,) = asyncio.run(
        continue_trajectories(
            [state],
            [ToolRunner({"f": lambda: "r"}, timeout=5)],
            [0],
            sampler=_ReloadInsideTurnTwo(),
            rules=TrajectoryRules(
                limits=ContinuationLimits(max_completion_length=64, max_model_len=256, max_tool_calling_iterations=4),
                parse=_parse,
                suffix_ids=lambda messages: [5, 6],
            ),
            stats=ToolStats(),
        )
    )
    return done


def test_every_token_of_a_trajectory_keeps_the_version_that_sampled_it():
    """full_weight_reload='keep': a reload inside a later turn splits that turn's tokens between two versions; tool
    results (never sampled) take the version of the turn before them; the ids and the versions stay aligned."""
    done = _versioned_run([0, 0])
    assert done.completion_ids == [10, END, 5, 6, 10, END, 5, 6, 11, END]
    assert done.token_versions == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1]
    assert done.turn_versions == [0, 0, 0]
    assert _versioned_run(None).token_versions is None  # a first turn without them: none for the trajectory


def test_both_engines_trajectories_take_their_rules_from_the_one_builder(default_tokenizer):
    """The colocated loop and the servers' sampler build their rules with ``tool_trajectory_rules``: the budget, the
    cap on a tool message, the template check and its policy, and the tool timeout all come from the config."""
    from types import SimpleNamespace

    from trlx_scale.agents.trajectory_rules import tool_trajectory_rules

    args = SimpleNamespace(
        max_turn_tokens=8,
        max_tool_response_tokens=4,
        tool_response_overflow="truncate",
        prefix_mismatch="discard",
        tool_timeout=2.5,
    )
    trainer = SimpleNamespace(
        args=args,
        max_completion_length=50,
        max_tool_calling_iterations=3,
        chat_template=None,
        chat_template_kwargs={},
    )
    rules = tool_trajectory_rules(trainer, tokenizer=default_tokenizer, max_model_len=100, suffix_ids=lambda m: [5])
    assert rules.limits == ContinuationLimits(50, 100, 3, max_turn_tokens=8)
    cut, changed = rules.fit_tool_message({"role": "tool", "name": "search", "content": "abcdefghij"})
    assert changed and cut["content"] == "abcd"
    assert rules.prefix_mismatch == "discard" and rules.runner({}).timeout == 2.5 and rules.suffix_ids([]) == [5]
    conversation = [{"role": "user", "content": "What is 2 + 3?"}]
    rendered = default_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert rules.prefix_mismatch_at(conversation, rendered, None) is None
    assert rules.prefix_mismatch_at(conversation, [*rendered[:3], rendered[3] + 1], None) == 3
    uncapped = tool_trajectory_rules(
        SimpleNamespace(
            **{**vars(trainer), "args": SimpleNamespace(**{**vars(args), "max_tool_response_tokens": None})}
        ),
        tokenizer=default_tokenizer,
        max_model_len=100,
        suffix_ids=lambda m: [5],
    )
    assert uncapped.fit_tool_message is None
