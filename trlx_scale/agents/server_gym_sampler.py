"""Gym-style episodes on the vLLM servers, for ``AsyncGRPOTrainer``'s producer: a ``GroupSampler`` whose completions
are whole ``GymRollout`` episodes.

A group (one dataset row, ``n`` episodes) runs on the producer's event loop: each episode gets an environment of its
own (``GymRollout.run_episodes``: reset from the row, its synchronous methods off the loop's thread under
``environment_timeout``), and every turn, the first included, is one request to the replica the group's index picks
(``VLLMServerClient.sample_turn``: sticky, so the replica's prefix cache holds the episode's context), sent as soon as
the environment has answered, while other episodes of this group and of the other groups in flight generate or wait
on theirs. Turns are sampled by the version the schedule admitted the group at (an adapter) or by the servers' newer
full weights after a reload, each turn's log-probs those of the weights that sampled it (as for tool trajectories,
``server_tool_sampler``); the group's version is its oldest first turn's.

The group carries the episodes' ids and behaviour log-probs, and in ``extras`` (plain values: a checkpoint's rollout
window saves them) what ``GymRollout.trl_output`` returns beside them (the prompt ids, ``env_mask``, the reward
functions' extra fields) and the episodes' ``agents/*`` metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..rollout.async_producer import GroupRequest, SampledGroup
from .gym_rollout import GymRollout
from .multi_turn_rollout import trajectory_metrics
from .server_tool_sampler import ReplicaTurns, trajectory_seed
from .trajectory_tokens import ObservationRenderer, TurnBudget

# Keys of ``SampledGroup.extras`` a gym group carries.
GYM_FIELDS = "gym_fields"  # GymRollout.trl_output's values but completion_ids and logprobs, per episode
GYM_METRICS = "gym_metrics"
# The fields of GYM_FIELDS that are TRL's rollout_func keys rather than reward-function arguments.
ROLLOUT_KEYS = ("prompt_ids", "env_mask")


class ServerGymGroupSampler:
    """See the module docstring; ``parse(ids)`` reads a turn's assistant message on the producer's own tokenizer."""

    def __init__(
        self,
        client: Any,
        gym: GymRollout,
        *,
        renderer: ObservationRenderer,
        parse: Callable[[list[int]], dict[str, Any]],
        budget: TurnBudget,
        tokenizer: Any,
        prefix_mismatch: str = "keep",
    ):
        self.client, self.gym = client, gym
        self.common = dict(
            renderer=renderer, parse=parse, budget=budget, tokenizer=tokenizer, prefix_mismatch=prefix_mismatch
        )

    async def sample(self, request: GroupRequest) -> SampledGroup:
        row = request.prompt["row"]
        count = request.num_generations
        trajectories = await self.gym.run_episodes(
            [row["prompt"]] * count,
            [row] * count,
            [trajectory_seed(request.seed, position) for position in range(count)],
            sampler=ReplicaTurns(self.client, request.version, request.index),
            **self.common,
        )
        output = self.gym.trl_output(trajectories)
        first_versions = [t.turn_versions[0] for t in trajectories if t.turn_versions]
        fields = {key: value for key, value in output.items() if key not in ("completion_ids", "logprobs")}
        metrics = trajectory_metrics(trajectories)
        crossed = [len(set(t.turn_versions)) > 1 for t in trajectories]
        metrics["async/trajectories_across_versions_frac"] = sum(crossed) / max(len(crossed), 1)
        token_versions = [t.tokens.versions for t in trajectories]
        aligned = all(
            versions is not None and len(versions) == len(ids)
            for versions, ids in zip(token_versions, output["completion_ids"], strict=True)
        )
        return SampledGroup(
            token_versions=token_versions if aligned else None,
            completion_ids=output["completion_ids"],
            logprobs=output["logprobs"],
            version=min(first_versions, default=request.version),
            prompt_ids=list(output["prompt_ids"][0]),
            extras={GYM_FIELDS: fields, GYM_METRICS: metrics},
        )
