"""Dynamic sampling in the asynchronous producer (``rollout.group_replacement``): a group without signal is dropped
and its slot sampled again with a replacement prompt, by the slot's version, within a bounded number of attempts;
what a slot trains on does not depend on timing. The trainer end to end on a real server: test_async_grpo.py."""

from __future__ import annotations

import time

import pytest

from trlx_scale.rollout.async_producer import RolloutProducer, group_seed
from trlx_scale.rollout.group_replacement import GroupReplacement, attempt_seed
from trlx_scale.rollout.staleness import StalenessSchedule

from .helpers.simulated_engine import SimulatedEngine

MAX_ATTEMPTS = 3
# Prompts whose completions all get the same reward: slot 3's first prompt (one replacement fixes it) and every
# prompt of slot 6 (it runs out of attempts).
FLAT = {"prompt-3", "prompt-6", "prompt-6/r1", "prompt-6/r2"}


async def _score(request, sampled):
    if request.prompt in FLAT:
        return [[1.0] for _ in sampled.completion_ids]
    return [[float(position)] for position, _ in enumerate(sampled.completion_ids)]


def _replacement() -> GroupReplacement:
    return GroupReplacement(
        keeps=lambda rewards: len({row[0] for row in rewards}) > 1,
        prompt_for=lambda first, attempt: f"{first}/r{attempt}",
        max_attempts=MAX_ATTEMPTS,
        token_count=lambda sampled: sum(len(ids) for ids in sampled.completion_ids),
    )


def _run(engine: SimulatedEngine, *, train_time: float, steps: int = 4, groups_per_step: int = 2, max_staleness=1):
    schedule = StalenessSchedule(groups_per_version=groups_per_step, max_staleness=max_staleness)
    producer = RolloutProducer(
        prompt_for=lambda k: f"prompt-{k}",
        sampler=engine,
        score=_score,
        schedule=schedule,
        num_generations=4,
        seed=0,
        max_inflight_tasks=64,
        queue_maxsize=1024,
        replacement=_replacement(),
    )
    producer.start()
    taken = []
    try:
        engine.publish(0)
        producer.publish_version(0)
        for step in range(steps):
            upcoming = producer.peek(groups_per_step, timeout=30)
            groups = producer.take(groups_per_step, timeout=30)
            assert [group.request for group in upcoming] == [group.request for group in groups]
            taken.extend(groups)
            time.sleep(train_time)
            engine.publish(step + 1)
            producer.publish_version(step + 1)
    finally:
        producer.close()
    return taken, schedule


def test_a_group_without_signal_is_replaced_by_its_slots_version():
    taken, schedule = _run(SimulatedEngine(slots=8, mean_group_time=0.005), train_time=0.01)
    assert [group.index for group in taken] == list(range(8))  # the slots, in order: the schedule's numbering
    by_index = {group.index: group for group in taken}
    # Slot 3: its first group was dropped, the replacement (another prompt, another seed) kept.
    assert by_index[3].attempts == 2 and by_index[3].informative
    assert by_index[3].request.prompt == "prompt-3/r1"
    assert by_index[3].dropped_tokens == 4 * 4  # the dropped group's 4 completions of 4 tokens (simulated engine)
    first_seed = group_seed(0, schedule.sampled_at(3), 3)
    assert by_index[3].request.seed == attempt_seed(first_seed, 1) != first_seed
    # Slot 6 ran out of attempts: its last group is trained on, and says it carries no signal.
    assert by_index[6].attempts == MAX_ATTEMPTS and not by_index[6].informative
    assert by_index[6].request.prompt == f"prompt-6/r{MAX_ATTEMPTS - 1}"
    assert by_index[6].dropped_tokens == (MAX_ATTEMPTS - 1) * 4 * 4
    # Every other slot kept its first group.
    assert all(by_index[k].attempts == 1 and by_index[k].informative for k in (0, 1, 2, 4, 5, 7))
    assert all(by_index[k].dropped_tokens == 0 for k in (0, 1, 2, 4, 5, 7))
    assert all(group.request.prompt == f"prompt-{group.index}" for group in taken if group.attempts == 1)
    # Each group, replacements included, was sampled by its slot's version, inside the bound.
    for group in taken:
        assert group.request.version == schedule.sampled_at(group.index) == group.sampled.version
        assert group.staleness == schedule.trained_at(group.index) - group.sampled.version <= 1


def test_what_a_slot_trains_on_does_not_depend_on_timing():
    fast, _ = _run(SimulatedEngine(slots=8, mean_group_time=0.002), train_time=0.0)
    slow, _ = _run(SimulatedEngine(slots=2, mean_group_time=0.02), train_time=0.03)
    assert [(g.request, g.sampled.completion_ids, g.rewards, g.attempts) for g in fast] == [
        (g.request, g.sampled.completion_ids, g.rewards, g.attempts) for g in slow
    ]


def test_a_replacement_needs_at_least_one_attempt():
    with pytest.raises(ValueError, match="max_attempts must be at least 1"):
        GroupReplacement(keeps=lambda rewards: True, prompt_for=lambda first, attempt: first, max_attempts=0)
