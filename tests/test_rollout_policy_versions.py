"""rollout/policy_version.py's RolloutPolicyVersions: under asynchronous generation each group carries the trainer's
policy version of the weights that sampled it (the schedule numbers rollouts; a skipped step is a rollout, not an
update), and a checkpoint's window keeps it."""

from __future__ import annotations

import pytest
import torch

from trlx_scale.rollout.async_producer import GroupRequest, SampledGroup, ScoredGroup
from trlx_scale.rollout.policy_version import RolloutPolicyVersions
from trlx_scale.rollout.rollout_window import load_window, save_window


def _group(index: int, rollout: int) -> ScoredGroup:
    sampled = SampledGroup([[5, 6]], [[-0.1, -0.2]], version=rollout, prompt_ids=[1])
    return ScoredGroup(GroupRequest(index, {"prompt_ids": [1]}, 1, rollout, 9), sampled, [[1.0]], 0)


def test_groups_get_their_rollouts_policy_version_and_the_window_keeps_it(tmp_path):
    versions = RolloutPolicyVersions()
    for rollout, policy_version in [(0, 0), (1, 1), (2, 1)]:  # the step before rollout 2 was skipped
        versions.record(rollout, policy_version)
    versions.record(2, 2)  # recorded again later (TRL's sync_weights): the weights published stay the first's
    groups = [_group(index, rollout) for index, rollout in enumerate([0, 1, 2, 2])]
    for group in groups:
        versions.tag(group.sampled)
    assert [RolloutPolicyVersions.of(group.sampled) for group in groups] == [0, 1, 1, 1]
    path = str(tmp_path / "window.pt")
    save_window(path, groups, {})
    _, restored = load_window(path)
    assert [RolloutPolicyVersions.of(group.sampled) for group in restored] == [0, 1, 1, 1]
    resumed = RolloutPolicyVersions()  # a resumed run has no record of the interrupted run's rollouts
    for group in restored:
        resumed.tag(group.sampled)  # the window's value stands
    assert [RolloutPolicyVersions.of(group.sampled) for group in restored] == [0, 1, 1, 1]

    with pytest.raises(RuntimeError, match="rollout 7's weights, which were never published"):
        versions.tag(_group(9, 7).sampled)


def test_a_window_saved_without_policy_versions_falls_back_to_the_rollout(tmp_path):
    path = str(tmp_path / "window.pt")
    save_window(path, [_group(0, 3)], {})
    state = torch.load(path, weights_only=True)
    del state["policy_versions"]  # what a window of an earlier trlx_scale holds
    torch.save(state, path)
    _, (restored,) = load_window(path)
    assert RolloutPolicyVersions.of(restored.sampled) == 3


def test_each_tokens_policy_version_when_a_reload_landed_inside_a_completion(tmp_path):
    """full_weight_reload='keep': the server's per-token rollout versions become policy versions (rollout 2 reused
    rollout 1's weights: a skipped step), survive the checkpoint's window, and groups without them get their own
    version for every token."""
    versions = RolloutPolicyVersions()
    for rollout, policy_version in [(0, 0), (1, 1), (2, 1), (3, 2)]:
        versions.record(rollout, policy_version)
    group = _group(0, 1)
    group.sampled.token_versions = [[1, 3]]  # the second token after rollout 3's reload
    versions.tag(group.sampled)
    assert RolloutPolicyVersions.of(group.sampled) == 1
    assert RolloutPolicyVersions.of_tokens(group.sampled) == [[1, 2]]
    path = str(tmp_path / "window.pt")
    save_window(path, [group], {})
    _, restored = load_window(path)
    assert RolloutPolicyVersions.of_tokens(restored[0].sampled) == [[1, 2]]
    plain = _group(1, 2)
    versions.tag(plain.sampled)
    assert RolloutPolicyVersions.of_tokens(plain.sampled) == [[1, 1]]
