"""Multi-turn trajectories without lockstep: each trajectory is its own task, its next turn sampled as soon as its
environment has answered, whatever the others are doing.

TRL 1.16's ``_tool_call_loop`` advances the batch turn by turn: every turn waits for the slowest generation and the
slowest tool of the whole batch, and a trajectory needing four turns holds the batch through four rounds. Here
``run_trajectories`` starts one coroutine per trajectory (at most ``max_concurrent`` at once: the environments'
capacity) and each loops on its own:

1. ``max_tokens`` for the turn from ``TurnBudget`` (0: the trajectory's total or the context is spent, stop);
2. the sampler continues the held ids (token-in/token-out: ``TrajectoryTokens.context_ids``, never a re-rendered
   conversation); the sampled ids are kept as sampled, with their log-probs;
3. the turn is parsed into an assistant message; a turn that ended on the length limit ends the trajectory (no tool
   runs on a cut-off call), as does a tool call past ``max_tool_calling_iterations``;
4. the environment answers (tools run concurrently, under their timeouts: ``environments``); its messages are fitted
   to ``max_tool_response_tokens``, rendered alone and appended (masked out of the loss); an answer that would not
   fit the budget ends the trajectory before it;
5. the held ids are checked against the template's rendering (``prefix_mismatch`` policy).

The sampler is whatever engine serves the trainer (``TurnSampler``): a server engine's requests run concurrently on
the server, whose continuous batching takes whatever turns are ready. Why a trajectory ended is kept
(``Trajectory.stop_reason``) for the metrics and for zeroing the reward of those that did not stop cleanly.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .environments import AgentEnvironment
from .trajectory_tokens import PREFIX_MISMATCH_POLICIES, ObservationRenderer, TrajectoryTokens, TurnBudget

STOP_REASONS = ("done", "length", "budget", "tool_rounds")
CLEAN_STOPS = ("done",)  # the environment or the model ended it (no tool call left unanswered, nothing cut)


@dataclasses.dataclass(frozen=True)
class SampledTurn:
    """One turn from the engine: the ids as sampled, their log-probs, and why sampling stopped."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (an end token) or "length" (max_tokens reached)
    version: int | None = None  # the policy version that sampled it, where the engine knows (the servers)
    # Each token's version, where a weight update can land inside the turn (full weights reloaded with requests kept
    # in flight: ``full_weight_reload="keep"``); ``version`` is then the oldest of them.
    token_versions: list[int] | None = None


class TurnSampler(Protocol):
    """Continues a token sequence by one turn (an engine's async completion call). ``seed`` is the trajectory's
    (an engine seeds turn ``turn`` from both, and may route a trajectory's turns by it: its prefix stays cached)."""

    async def sample(self, prompt_ids: list[int], max_tokens: int, seed: int, turn: int) -> SampledTurn: ...


@dataclasses.dataclass
class Trajectory:
    """A finished trajectory: its tokens, its conversation after the prompt (what TRL's reward functions get as the
    completion), why it ended, and what the environment scored."""

    prompt: list[dict[str, Any]]  # the opening conversation (after the environment's reset)
    tokens: TrajectoryTokens
    completion: list[dict[str, Any]]
    stop_reason: str
    turn_rewards: list[float | None]  # each environment step's reward, in turn order (None: the step gave none)
    final_reward: float | None
    tool_rounds: int
    prefix_mismatches: int  # turns after which the held ids were not a prefix of the template's rendering
    truncated_tool_responses: int
    turn_versions: list[int] = dataclasses.field(default_factory=list)  # each turn's policy version, where known

    @property
    def stopped_cleanly(self) -> bool:
        return self.stop_reason in CLEAN_STOPS


async def run_trajectory(
    *,
    sampler: TurnSampler,
    environment: AgentEnvironment,
    renderer: ObservationRenderer,
    parse: Callable[[list[int]], dict[str, Any]],
    budget: TurnBudget,
    prompt: list[dict[str, Any]],
    row: dict[str, Any],
    seed: int,
    tokenizer: Any,
    prefix_mismatch: str = "keep",
) -> Trajectory:
    """One trajectory, turn after turn (see the module docstring)."""
    if prefix_mismatch not in PREFIX_MISMATCH_POLICIES:
        raise ValueError(f"prefix_mismatch must be one of {PREFIX_MISMATCH_POLICIES}, got {prefix_mismatch!r}.")
    opening = await environment.reset(prompt, row)
    tokens = TrajectoryTokens(renderer.render(opening, add_generation_prompt=True))
    conversation, completion, turn_rewards = list(opening), [], []
    rounds = mismatches = truncated = 0
    stop_reason = "budget"
    versions: list[int] = []
    while True:
        max_tokens = budget.next_turn_tokens(tokens)
        if max_tokens == 0:
            stop_reason = "budget"
            break
        turn = await sampler.sample(tokens.context_ids, max_tokens, seed, tokens.turns)
        tokens.add_sampled(turn.ids, turn.logprobs, turn.token_versions)
        if turn.version is not None:
            versions.append(turn.version)
        message = parse(turn.ids)
        conversation.append(message)
        completion.append(message)
        if turn.finish_reason == "length":
            stop_reason = "length"  # a cut-off turn: its tool call (if any) is not run
            break
        if message.get("tool_calls") and not budget.tool_rounds_left(rounds):
            stop_reason = "tool_rounds"
            break
        step = await environment.step(message)
        turn_rewards.append(step.reward)
        if step.done:
            stop_reason = "done"
            break
        if not budget.tool_rounds_left(rounds):
            # An environment that answers every turn (no tool call to count) is bounded by the same rounds.
            stop_reason = "tool_rounds"
            break
        answers = []
        for answer in step.messages:
            fitted, changed = budget.fit_tool_message(answer, tokenizer)
            answers.append(fitted)
            truncated += changed
        observation = renderer.observation_ids(answers)
        if len(tokens.completion_ids) + len(observation) >= budget.max_completion_length or (
            len(tokens.context_ids) + len(observation) >= budget.max_model_len
        ):
            stop_reason = "budget"  # the answer would leave no room for a turn: end on the call, as TRL does
            break
        rounds += 1
        conversation += answers
        completion += answers
        tokens.add_observation(observation)
        if prefix_mismatch != "off" and renderer.first_mismatch(conversation, tokens.context_ids) is not None:
            mismatches += 1
            tokens.discarded = tokens.discarded or prefix_mismatch == "discard"
    return Trajectory(
        prompt=opening,
        tokens=tokens,
        completion=completion,
        stop_reason=stop_reason,
        turn_rewards=turn_rewards,
        final_reward=await environment.final_reward(),
        tool_rounds=rounds,
        prefix_mismatches=mismatches,
        truncated_tool_responses=truncated,
        turn_versions=versions,
    )


async def run_trajectories(
    *,
    prompts: Sequence[list[dict[str, Any]]],
    rows: Sequence[dict[str, Any]],
    environments: Sequence[AgentEnvironment],
    seeds: Sequence[int],
    max_concurrent: int | None = None,
    **common: Any,
) -> list[Trajectory]:
    """Every trajectory at once, each at its own pace (at most ``max_concurrent`` in flight); in input order."""
    if not len(prompts) == len(rows) == len(environments) == len(seeds):
        raise ValueError("prompts, rows, environments and seeds must have one entry per trajectory.")
    limit = asyncio.Semaphore(max_concurrent or len(prompts) or 1)

    async def bounded(index: int) -> Trajectory:
        async with limit:
            return await run_trajectory(
                environment=environments[index], prompt=prompts[index], row=rows[index], seed=seeds[index], **common
            )

    # The first trajectory that fails (an environment's error) cancels the others, so none is left running, and its
    # error is raised as it is.
    tasks = [asyncio.ensure_future(bounded(index)) for index in range(len(prompts))]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        raise
    failed = [task for task in tasks if task in done and not task.cancelled() and task.exception() is not None]
    if failed:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        raise failed[0].exception()
    return [task.result() for task in tasks]


def trajectory_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``agents/*`` metrics of a batch of trajectories (turns, tool rounds, why they ended, prefix mismatches)."""
    count = max(len(trajectories), 1)
    metrics = {
        "agents/turns_mean": sum(t.tokens.turns for t in trajectories) / count,
        "agents/tool_rounds_mean": sum(t.tool_rounds for t in trajectories) / count,
        "agents/prefix_mismatch_frac": sum(t.prefix_mismatches > 0 for t in trajectories) / count,
        "agents/truncated_tool_responses": float(sum(t.truncated_tool_responses for t in trajectories)),
    }
    for reason in STOP_REASONS:
        metrics[f"agents/stopped_{reason}_frac"] = sum(t.stop_reason == reason for t in trajectories) / count
    return metrics
