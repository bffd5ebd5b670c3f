"""rollout/reward_logs.py: what reward functions log through TRL's log_metric / log_extra while the asynchronous
producer scores a group is replayed at the step that trains it, aligned with the rollout's completions, and a
checkpoint's window keeps the metrics."""

from __future__ import annotations

import pytest

from trlx_scale.rollout.async_producer import GroupRequest, SampledGroup, ScoredGroup
from trlx_scale.rollout.reward_logs import REWARD_LOG_KEY, GroupRewardLog, replay_reward_logs
from trlx_scale.rollout.rollout_window import load_window, save_window


def _replayed(logs):
    metrics, extras = [], {}
    replay_reward_logs(logs, lambda name, value: metrics.append((name, value)), extras.__setitem__)
    return metrics, extras


def test_groups_are_replayed_in_order_and_a_column_some_groups_lack_is_padded():
    first, second = GroupRewardLog(2), GroupRewardLog(3)
    first.log_metric("judge/latency", 0.5)
    second.log_metric("judge/latency", 1.5)
    second.log_extra("verdict", ["ok", "bad", "ok"])
    first.log_extra("note", ["a"])  # fewer values than completions: the rest of the group shows None
    metrics, extras = _replayed([first, second])
    assert metrics == [("judge/latency", 0.5), ("judge/latency", 1.5)]
    assert extras == {"note": ["a", None, None, None, None], "verdict": [None, None, "ok", "bad", "ok"]}


def test_more_values_than_completions_is_an_error_naming_the_column():
    log = GroupRewardLog(2)
    log.log_extra("verdict", ["ok", "ok", "ok"])
    with pytest.raises(ValueError, match="column 'verdict'.*group of 2 completions"):
        _replayed([log])


def test_a_checkpoints_window_keeps_the_groups_metrics(tmp_path):
    sampled = SampledGroup([[5, 6], [7]], [[-0.1, -0.2], [-0.3]], version=1, prompt_ids=[1, 2])
    log = GroupRewardLog(2)
    log.log_metric("judge/calls", 2.0)
    log.log_extra("verdict", ["ok", "bad"])
    sampled.extras[REWARD_LOG_KEY] = log
    path = str(tmp_path / "window.pt")
    save_window(path, [ScoredGroup(GroupRequest(4, {"prompt_ids": [1, 2]}, 2, 1, 9), sampled, [[1.0], [0.0]], 1)], {})
    _, (restored,) = load_window(path)
    restored_log = restored.sampled.extras[REWARD_LOG_KEY]
    assert restored_log.metrics == [("judge/calls", 2.0)]
    assert _replayed([restored_log])[1] == {}  # columns (arbitrary objects) are not kept: None in the table
