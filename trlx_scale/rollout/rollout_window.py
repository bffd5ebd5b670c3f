"""The staleness window a checkpoint carries: the groups already sampled by policy versions older than its weights.

With ``max_staleness`` s > 0 the groups trained in the s steps after checkpoint ``N`` were sampled (or admitted) by
versions before ``N``, whose weights a resumed run no longer has. Regenerating them from the checkpoint's weights
would be inside the bound but not what the interrupted run trained on. So the checkpoint saves them: at save time the
producer samples and scores every group the published version admits (``RolloutProducer.admitted_groups``), and
each rank writes its own groups here; a resumed run queues them before anything new is sampled, and continues the
interrupted run's schedule from there. Those groups were needed anyway (they are the next ones trained), so the save
waits for work that is not wasted.

The file holds tensors and plain values only (``torch.load(weights_only=True)``): completion token ids, the
behaviour log-probs in float64 (the server's values, bit for bit), the rewards, and per group its index, request
version, seed, sampled version, staleness, prompt ids and dynamic sampling's attempts, its completions as the sampler gave them (text, or a
multi-turn trajectory's messages) and the sampler's other ``extras`` (a multi-turn group's first turns, tool masks
and counts: ``agents.server_tool_sampler``), which must be plain values too. The settings that decide the schedule
are saved beside them; a run whose settings differ regenerates the window instead (``window_mismatch``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..atomic_files import replace_atomically
from .async_producer import GroupRequest, SampledGroup, ScoredGroup
from .policy_version import RolloutPolicyVersions
from .reward_logs import REWARD_LOG_KEY, GroupRewardLog

WINDOW_STATE_NAME = "async_rollout_window_rank{}.pt"
FORMAT_VERSION = 1


def _reward_log(group: ScoredGroup) -> GroupRewardLog:
    return group.sampled.extras.get(REWARD_LOG_KEY) or GroupRewardLog(len(group.sampled.completion_ids))


# Extras the window writes in fields of their own (above); every other extra is saved as it is.
_OWN_FIELDS = (REWARD_LOG_KEY, RolloutPolicyVersions.EXTRAS_KEY)
_PLAIN = (str, int, float, bool, type(None))


def _is_plain(value: Any) -> bool:
    """What ``torch.load(weights_only=True)`` reads back: primitives in lists, tuples and str-keyed dicts."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _is_plain(item) for key, item in value.items())
    return False


def _plain_extras(group: ScoredGroup) -> dict[str, Any]:
    extras = {key: value for key, value in group.sampled.extras.items() if key not in _OWN_FIELDS}
    for key, value in extras.items():
        if not _is_plain(value):
            raise TypeError(
                f"group {group.index}: the sampler's extra {key!r} ({type(value).__name__}) is not a plain value "
                "(str, int, float, bool, None in lists and dicts): a checkpoint's rollout window cannot save it. "
                "Store it as plain values, or drop it once the group is scored."
            )
    return extras


def save_window(path: str, groups: list[ScoredGroup], settings: dict[str, int]) -> None:
    """Write ``groups`` (in index order) and the schedule ``settings`` to ``path`` atomically."""
    extras = [_plain_extras(group) for group in groups]  # first: a group that cannot be saved writes nothing
    texts = [group.sampled.completions for group in groups]
    for group, completions in zip(groups, texts, strict=True):
        if not _is_plain(completions):
            raise TypeError(f"group {group.index}: its completions are not plain values; the window cannot save them.")
    completions = [ids for group in groups for ids in group.sampled.completion_ids]
    logprobs = [values for group in groups for values in group.sampled.logprobs]
    state: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "settings": dict(settings),
        "indices": [group.index for group in groups],
        "request_versions": [group.request.version for group in groups],
        "seeds": [group.request.seed for group in groups],
        "sampled_versions": [group.sampled.version for group in groups],
        "staleness": [group.staleness for group in groups],
        # Dynamic sampling: how many groups each slot sampled, and whether the one kept had signal.
        "attempts": [group.attempts for group in groups],
        "informative": [group.informative for group in groups],
        "dropped_tokens": [group.dropped_tokens for group in groups],
        # The trainer's policy version of the weights that sampled each group (the sampled version is the rollout's).
        "policy_versions": [group.sampled.extras.get(RolloutPolicyVersions.EXTRAS_KEY) for group in groups],
        "prompt_ids": [list(group.sampled.prompt_ids or []) for group in groups],
        "group_sizes": [len(group.sampled.completion_ids) for group in groups],
        "lengths": torch.tensor([len(ids) for ids in completions], dtype=torch.long),
        "completion_ids": torch.tensor([token for ids in completions for token in ids], dtype=torch.long),
        "logprobs": torch.tensor([value for values in logprobs for value in values], dtype=torch.float64),
        # What the reward functions logged through log_metric: the resumed run reports it at the step that trains them.
        "reward_metrics": [[list(pair) for pair in _reward_log(group).metrics] for group in groups],
        "completions": texts,
        "extras": extras,
        "rewards": [
            torch.tensor(
                [[math.nan if value is None else value for value in row] for row in group.rewards], dtype=torch.float64
            )
            for group in groups
        ],
    }
    replace_atomically(path, lambda temporary: torch.save(state, temporary))


def load_window(path: str) -> tuple[dict[str, int], list[ScoredGroup]]:
    """The settings and the groups ``save_window`` wrote."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: unknown rollout window format {state.get('format')!r} (expected {FORMAT_VERSION}).")
    lengths = state["lengths"].tolist()
    ids = state["completion_ids"].split(lengths)
    logprobs = state["logprobs"].split(lengths)
    groups, row = [], 0
    for position, index in enumerate(state["indices"]):
        size = state["group_sizes"][position]
        prompt_ids = state["prompt_ids"][position]
        request = GroupRequest(
            index=index,
            prompt={"prompt_ids": prompt_ids},
            num_generations=size,
            version=state["request_versions"][position],
            seed=state["seeds"][position],
        )
        sampled = SampledGroup(
            completion_ids=[ids[row + i].tolist() for i in range(size)],
            logprobs=[logprobs[row + i].tolist() for i in range(size)],
            version=state["sampled_versions"][position],
            prompt_ids=prompt_ids,
            completions=state.get("completions", [None] * len(state["indices"]))[position],
        )
        sampled.extras.update(state.get("extras", [{}] * len(state["indices"]))[position])
        metrics = state.get("reward_metrics", [[]] * len(state["indices"]))[position]
        sampled.extras[REWARD_LOG_KEY] = GroupRewardLog(
            size, metrics=[(name, float(value)) for name, value in metrics]
        )
        # A window saved before policy versions were kept: its rollouts' weights are the step's (no skipped step
        # known), as the policy version's checkpoint part assumes for such a checkpoint.
        policy_version = state.get("policy_versions", [None] * len(state["indices"]))[position]
        sampled.extras[RolloutPolicyVersions.EXTRAS_KEY] = (
            sampled.version if policy_version is None else policy_version
        )
        rewards = state["rewards"][position].tolist()
        count = len(state["indices"])
        groups.append(
            ScoredGroup(
                request,
                sampled,
                rewards,
                state["staleness"][position],
                attempts=state.get("attempts", [1] * count)[position],
                informative=state.get("informative", [True] * count)[position],
                dropped_tokens=state.get("dropped_tokens", [0] * count)[position],
            )
        )
        row += size
    return state["settings"], groups


def window_mismatch(saved: dict[str, int], current: dict[str, int]) -> str | None:
    """Why a saved window cannot continue this run's schedule (a setting that differs), or None if it can."""
    for name in sorted(set(saved) | set(current)):
        if name == "oldest_version":  # the interrupted run's, continued as it is
            continue
        if saved.get(name) != current.get(name):
            return f"{name} was {saved.get(name)} when it was saved, is {current.get(name)} now"
    return None
