"""Multi-turn groups on the vLLM servers, for ``AsyncGRPOTrainer``'s producer: a ``GroupSampler`` whose completions
are whole tool-calling trajectories.

A group (one prompt, ``n`` trajectories), in numbered steps, all on the producer's event loop:

1. Each trajectory gets what it may call (``TrajectoryTools``: standalone tools, or the methods of an environment of
   its own, reset for the group's row off the event loop's thread; ``tools_for``).
2. The first turn of the ``n`` trajectories is one request (``VLLMServerClient.sample``: the prompt sent once, the
   group's seed, the version the schedule admitted), as for single-turn groups.
3. Every trajectory then continues at its own pace (``continue_trajectories``, the synchronous trainer's concurrent
   loop): its tool calls run concurrently off the loop's thread under ``tool_timeout``, the tool messages are
   rendered alone and appended to the held ids (token-in/token-out), and its next turn goes to the same replica as
   soon as its tools returned (``VLLMServerClient.sample_turn``: the replica's prefix cache holds the trajectory's
   context), while other trajectories of this group and of the other groups in flight generate or wait on theirs.

A weight update landing mid-trajectory. With adapters, every turn of a trajectory is sampled by the version that
sampled its first turn: each request names that version's adapter, kept loaded while a group in flight can use it,
and an update pauses nothing. With full weights, a reload holds only the requests at the servers
(``RequestGate``), not the trajectories waiting on their tools: a turn sent after the reload is sampled by the new
weights, and each turn records the version that sampled it (``TrajectorySummary.turn_versions``). Under
``full_weight_reload="keep"`` nothing is held: a reload can land inside a turn, and every token carries the version
that sampled it (``SampledGroup.token_versions``; a tool result's tokens, never sampled, the version before them). Its tokens' behaviour
log-probs are that version's, so the importance correction of every token uses the weights that sampled it. The
schedule admits a group by its first turn's version (``SampledGroup.version``); later turns are at most as stale.
Chosen by measurement (docs/benchmarks.md, the async tools rows): holding the reload until every trajectory in flight
had finished on its first version (tools included) made each update wait for the slowest tool, and the asynchronous
trainer ran at 0.94x the synchronous concurrent loop.

The group returned carries the whole trajectories as its completions (what trains), their messages (what the reward
functions read), and in ``extras`` the first turns (what TRL's ``_generate`` parses) and the tool masks and counts
(what TRL's ``_tool_call_loop`` returns): ``async_grpo.tool_loop.ServerToolLoop`` hands them to TRL.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from ..generation.rollout_seeds import turn_seed
from ..rollout.async_producer import GroupRequest, SampledGroup
from .multi_turn_rollout import SampledTurn
from .tool_call_continuation import TrajectoryRules, TrajectoryState, continue_trajectories
from .tool_runner import ToolStats

# Keys of ``SampledGroup.extras`` a tool group carries.
FIRST_TURN_IDS = "first_turn_ids"
FIRST_TURN_LOGPROBS = "first_turn_logprobs"
TOOL_MASKS = "tool_masks"
TRAJECTORY_SUMMARIES = "trajectory_summaries"
TOOL_STATS = "tool_stats"
TRAJECTORY_TOOLS = "trajectory_tools"  # dropped once the group is scored (environments are not checkpointed)


@dataclasses.dataclass
class TrajectoryTools:
    """What one trajectory may call: its tool functions by name, the tools its prompt was rendered with (what
    ``parse_response`` reads tool calls against), and its environment (None for standalone tools) with the name it
    was made under (``environment_factory``'s key: the pool it goes back to)."""

    functions: dict[str, Callable]
    schema: list
    environment: Any = None
    environment_name: Any = None


@dataclasses.dataclass(frozen=True)
class TrajectorySummary:
    """What the trainer's metrics need of a finished trajectory (picklable: the checkpoint window keeps groups)."""

    tool_calls: int
    tool_failures: int
    tool_rounds: int
    truncated_tool_responses: int
    stop_reason: str
    prefix_mismatches: int = 0
    turn_versions: tuple[int, ...] = ()  # the policy version of each sampled turn, the first included


def tool_stats(extras: dict[str, Any]) -> ToolStats:
    """A tool group's tool counts and latencies (``extras[TOOL_STATS]``)."""
    return ToolStats(**extras[TOOL_STATS])


def trajectory_summaries(extras: dict[str, Any]) -> list[TrajectorySummary]:
    """A tool group's trajectory summaries (``extras[TRAJECTORY_SUMMARIES]``), in trajectory order."""
    return [
        TrajectorySummary(**{**values, "turn_versions": tuple(values["turn_versions"])})
        for values in extras[TRAJECTORY_SUMMARIES]
    ]


class ReplicaTurns:
    """A ``TurnSampler`` on one replica: the group's later turns, by its first turn's version or, with full weights
    reloaded since, by the servers' newer one (``VLLMServerClient.sample_turn``)."""

    def __init__(self, client: Any, version: int, replica: int):
        self.client, self.version, self.replica = client, version, replica

    async def sample(self, prompt_ids: list[int], max_tokens: int, seed: int, turn: int) -> SampledTurn:
        ids, logprobs, finish, version, token_versions = await self.client.sample_turn(
            prompt_ids, max_tokens, turn_seed(seed, turn), version=self.version, replica=self.replica
        )
        return SampledTurn(
            ids=ids, logprobs=logprobs, finish_reason=finish, version=version, token_versions=token_versions
        )


def trajectory_seed(group_seed: int, position: int) -> int:
    """The seed of trajectory ``position`` of a group sampled with ``group_seed``: its later turns are a function of
    the group's seed, not of timing."""
    digest = hashlib.blake2b(f"{group_seed}|trajectory|{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class ServerToolGroupSampler:
    """See the module docstring. ``rules`` are the trainer's (``agents.trajectory_rules``), built on the producer's own
    tokenizer; ``executor`` runs the synchronous tools."""

    def __init__(
        self,
        client: Any,
        *,
        tools_for: Callable[[GroupRequest], Awaitable[Sequence[TrajectoryTools]]],
        rules: TrajectoryRules,
        eos_token_ids: Sequence[int],
        executor: Executor,
    ):
        self.client = client
        self.tools_for = tools_for
        self.rules = rules
        self.eos_token_ids = set(eos_token_ids)
        self.executor = executor

    async def sample(self, request: GroupRequest) -> SampledGroup:
        tools = list(await self.tools_for(request))
        if len(tools) != request.num_generations:
            raise ValueError(f"tools_for gave {len(tools)} tool sets for a group of {request.num_generations}.")
        first = await self.client.sample(request)
        prompt_ids = list(first.prompt_ids)
        states = []
        first_versions = first.token_versions or [None] * len(first.completion_ids)
        for ids, logprobs, own, versions in zip(
            first.completion_ids, first.logprobs, tools, first_versions, strict=True
        ):
            message = self.rules.parse(list(ids), prompt_ids, own.schema)
            states.append(
                TrajectoryState(
                    prompt=list(request.prompt["row"]["prompt"]),
                    prompt_ids=prompt_ids,
                    completion_ids=list(ids),
                    completion=[message],
                    logprobs=list(logprobs),
                    tool_mask=[1] * len(ids),
                    tools=own.schema,
                    last_turn_cut=bool(ids) and ids[-1] not in self.eos_token_ids,
                    turn_versions=[first.version],
                    token_versions=None if versions is None else list(versions),
                )
            )
        stats = ToolStats()
        states = await continue_trajectories(
            states,
            [self.rules.runner(own.functions, self.executor) for own in tools],
            [trajectory_seed(request.seed, position) for position in range(len(states))],
            sampler=ReplicaTurns(self.client, first.version, request.index),
            rules=self.rules,
            stats=stats,
        )
        token_versions = [state.token_versions for state in states]
        return SampledGroup(
            completion_ids=[state.completion_ids for state in states],
            logprobs=[state.logprobs for state in states],
            version=first.version,
            token_versions=None if any(versions is None for versions in token_versions) else token_versions,
            completions=[state.completion for state in states],
            prompt_ids=prompt_ids,
            extras={
                FIRST_TURN_IDS: [list(ids) for ids in first.completion_ids],
                FIRST_TURN_LOGPROBS: [list(values) for values in first.logprobs],
                TOOL_MASKS: [state.tool_mask for state in states],
                # Plain values (a checkpoint's rollout window saves them): read back by tool_stats and trajectory_summaries.
                TOOL_STATS: dataclasses.asdict(stats),
                TRAJECTORY_SUMMARIES: [
                    dataclasses.asdict(
                        TrajectorySummary(
                            tool_calls=state.tool_calls,
                            tool_failures=state.tool_failures,
                            tool_rounds=state.tool_rounds,
                            truncated_tool_responses=state.truncated_tool_responses,
                            stop_reason=state.stop_reason,
                            prefix_mismatches=state.prefix_mismatches,
                            turn_versions=tuple(state.turn_versions),
                        )
                    )
                    for state in states
                ],
                TRAJECTORY_TOOLS: tools,
            },
        )
