"""The turns after TRL's first, without lockstep: each trajectory continues at its own pace.

TRL 1.16's ``GRPOTrainer._generate`` samples every trajectory's first turn in one batched call (a group's prompt
once, ``n`` samples), then hands the batch to ``_tool_call_loop``, which is lockstep: each round runs the tools of
every trajectory that called one (synchronous tools one after another, on the trainer's thread), then generates the
next turn of all of them in one call, which returns when the longest is done. A trajectory that needs four turns
holds the batch four rounds; a slow tool holds every trajectory.

``continue_trajectories`` takes over from the same state (TRL's lists: prompts, prompt and completion ids,
completions, log-probs) and returns what TRL's loop returns, computed per trajectory, each its own coroutine:

1. the tool calls of the trajectory's last assistant message run concurrently (``ToolRunner``: off the event loop's
   thread, each under a timeout; failures go back to the model as TRL's tool errors);
2. the tool messages are rendered alone (TRL's ``_get_tool_suffix_ids``, handed in as ``suffix_ids``) and appended
   to the held ids: token-in/token-out, nothing re-tokenized;
3. TRL's budget: a result that would take the completion past ``max_completion_length`` or the sequence to the
   model length is rolled back and the trajectory ends (TRL's rule); else the next turn's ``max_tokens`` is what is
   left of both, so a request never overflows the context (TRL asks for ``max_completion_length`` and cuts);
4. the next turn is sampled (``TurnSampler``: on the colocated engine, a request added to the running engine, so
   vLLM's continuous batching takes it with whatever other turns are in flight) and parsed (``parse(ids, held ids,
   the trajectory's tools)``);
5. repeat while the turn calls tools, up to ``max_tool_calling_iterations`` rounds; a turn cut at its token limit
   runs no tool (its call may be cut too), and a tool result can be capped (``fit_tool_message``).

Why each trajectory ended is kept (``TrajectoryState.stop_reason``, ``STOP_REASONS``). Where no turn is cut and no
result capped, the tokens, masks and messages are the ones TRL's loop produces (tool tokens masked 0, sampled tokens 1 with their
log-probs, tool tokens' log-probs 0): the test holds the two loops to each other on the real engine at temperature 0.
Only the scheduling differs. No collective is called after the first turn, so ranks whose trajectories take
different numbers of turns never wait on each other.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from .multi_turn_rollout import TurnSampler
from .tool_runner import ToolRunner, ToolStats


@dataclasses.dataclass
class TrajectoryState:
    """One trajectory as TRL's ``_tool_call_loop`` holds it; the lists are TRL's own and are extended in place."""

    prompt: list[dict[str, Any]]  # the conversation the next turn continues (TRL appends to it too)
    prompt_ids: list[int]
    completion_ids: list[int]
    completion: list[dict[str, Any]]  # the messages after the prompt (what reward functions get)
    logprobs: list[float] | None
    tool_mask: list[int]
    tools: Any = None  # what ``parse`` needs to read this trajectory's tool calls (the tools its prompt offered)
    last_turn_cut: bool = False  # the last turn ended on its token limit, not on the end token
    tool_calls: int = 0
    tool_failures: int = 0
    tool_rounds: int = 0
    truncated_tool_responses: int = 0
    stop_reason: str = "done"  # one of STOP_REASONS
    prefix_mismatches: int = 0  # turns whose held ids were not a prefix of the template's rendering
    discarded: bool = False  # prefix_mismatch="discard" masked it out of the loss
    # The policy version of each sampled turn, the first included, where the sampler reports one (the servers:
    # with full weights a reload between two turns makes the later one newer).
    turn_versions: list[int] = dataclasses.field(default_factory=list)
    # Each completion id's version, where every turn reports its tokens' (full weights reloaded with requests kept in
    # flight); tool-result ids take the version of the turn before them. None otherwise.
    token_versions: list[int] | None = None


# Why a trajectory ended: "done" (its last turn called no tool), "length" (its last turn was cut at its token limit:
# its call, if any, is not run), "budget" (a tool result would not fit: rolled back, TRL's rule), "tool_rounds" (it
# called a tool past max_tool_calling_iterations), "prefix_mismatch" (prefix_mismatch="discard": its held ids were
# not a prefix of the template's rendering; masked out of the loss).
STOP_REASONS = ("done", "length", "budget", "tool_rounds", "prefix_mismatch")


@dataclasses.dataclass(frozen=True)
class ContinuationLimits:
    max_completion_length: int  # sampled and tool tokens after the prompt, as TRL counts them
    max_model_len: int  # the engine's context
    max_tool_calling_iterations: int
    max_turn_tokens: int | None = None  # one later turn's own cap


@dataclasses.dataclass(frozen=True)
class TrajectoryRules:
    """What every trajectory continues under, whichever engine samples its turns (the sampler is the only part that
    differs between the colocated engine and the servers). Built from a trainer's config by
    ``agents.trajectory_rules.tool_trajectory_rules``.

    ``parse(ids, held ids, tools)`` reads a turn's assistant message; ``suffix_ids(messages)`` renders tool messages
    alone; ``fit_tool_message`` caps a tool result's tokens (``TurnBudget.fit_tool_message``; None: no cap);
    ``prefix_mismatch_at(conversation, held ids, tools)``: where the held ids stop being a prefix of the template's
    rendering of the conversation (None: they are one), checked before each later turn; ``prefix_mismatch`` is the
    policy (``agent_fields.PREFIX_MISMATCH``: "keep" counts it, "discard" ends the trajectory and masks it out of the
    loss, "off" does not check); ``tool_timeout`` bounds each tool call (``runner``)."""

    limits: ContinuationLimits
    parse: Callable[[list[int], list[int], Any], dict[str, Any]]
    suffix_ids: Callable[[list[dict[str, Any]]], list[int]]
    fit_tool_message: Callable[[dict[str, Any]], tuple[dict[str, Any], bool]] | None = None
    prefix_mismatch_at: Callable[[list[dict[str, Any]], list[int], Any], int | None] | None = None
    prefix_mismatch: str = "keep"
    tool_timeout: float = 60.0

    def runner(self, functions: dict[str, Callable], executor: Executor | None = None) -> ToolRunner:
        """A trajectory's tools, called under ``tool_timeout`` on ``executor``."""
        return ToolRunner(functions, timeout=self.tool_timeout, executor=executor)


async def continue_trajectory(
    state: TrajectoryState,
    *,
    runner: ToolRunner,
    sampler: TurnSampler,
    rules: TrajectoryRules,
    seed: int,
    stats: ToolStats,
) -> TrajectoryState:
    """Runs the trajectory's tool rounds and later turns (the module docstring's steps) under ``rules``; returns
    ``state``."""
    limits, parse, suffix_ids = rules.limits, rules.parse, rules.suffix_ids
    fit_tool_message, prefix_mismatch_at, prefix_mismatch = (
        rules.fit_tool_message,
        rules.prefix_mismatch_at,
        rules.prefix_mismatch,
    )
    tool_calls = state.completion[-1].get("tool_calls") if state.completion else None
    while tool_calls:
        if state.last_turn_cut:
            state.stop_reason = "length"  # a cut-off call is not run (TRL's loop runs whatever parses)
            break
        if state.tool_rounds >= limits.max_tool_calling_iterations:
            state.stop_reason = "tool_rounds"
            break
        completion_before, prompt_before = len(state.completion), len(state.prompt)
        state.prompt.append(state.completion[-1])  # the assistant message that called the tools
        results = await runner.run(tool_calls)
        messages = []
        for result in results:
            stats.record(result)
            state.tool_calls += 1
            state.tool_failures += result.outcome.value != "ok"
            if isinstance(result.message["content"], list):
                raise ValueError(
                    f"Tool {result.name} returned content blocks (images): tool_scheduling='concurrent' handles text "
                    "results only; set tool_scheduling='lockstep' for tools that return images."
                )
            message = result.message
            if fit_tool_message is not None:
                message, changed = fit_tool_message(message)
                state.truncated_tool_responses += changed
            messages.append(message)
        state.prompt.extend(messages)
        state.completion.extend(messages)
        held = state.prompt_ids + state.completion_ids + suffix_ids(messages)
        used = len(held) - len(state.prompt_ids)
        if used > limits.max_completion_length or len(held) >= limits.max_model_len:
            # TRL's rule: the results that do not fit are rolled back and the trajectory ends on its call.
            del state.completion[completion_before:]
            del state.prompt[prompt_before:]
            state.stop_reason = "budget"
            break
        if prefix_mismatch_at is not None and prefix_mismatch != "off":
            if prefix_mismatch_at(state.prompt, held, state.tools) is not None:
                state.prefix_mismatches += 1
                if prefix_mismatch == "discard":
                    del state.completion[completion_before:]
                    del state.prompt[prompt_before:]
                    state.discarded, state.stop_reason = True, "prefix_mismatch"
                    break
        max_tokens = min(limits.max_completion_length - used, limits.max_model_len - len(held))
        if limits.max_turn_tokens is not None:
            max_tokens = min(max_tokens, limits.max_turn_tokens)
        if max_tokens > 0:
            turn = await sampler.sample(held, max_tokens, seed, state.tool_rounds + 1)
            sampled_ids, sampled_logprobs = list(turn.ids), list(turn.logprobs)
            state.last_turn_cut = turn.finish_reason == "length"
            if turn.version is not None:
                state.turn_versions.append(turn.version)
        else:
            sampled_ids, sampled_logprobs = [], []
            state.last_turn_cut = True
        tool_length = len(held) - len(state.prompt_ids) - len(state.completion_ids)
        if state.token_versions is not None:
            sampled_versions = turn.token_versions if max_tokens > 0 else []
            if sampled_versions is None:
                state.token_versions = None  # a turn without them: the trajectory has none
            else:
                before = state.token_versions[-1] if state.token_versions else 0
                state.token_versions += [before] * tool_length + list(sampled_versions)
        state.tool_mask += [0] * tool_length + [1] * len(sampled_ids)
        if state.logprobs is not None:
            state.logprobs += [0.0] * tool_length + sampled_logprobs
        state.completion_ids = held[len(state.prompt_ids) :] + sampled_ids
        message = parse(sampled_ids, held, state.tools) if sampled_ids else {}
        if message:  # an empty turn (no budget left) adds no message, as in TRL
            state.completion.append(message)
        tool_calls = message.get("tool_calls")
        state.tool_rounds += 1
        state.stop_reason = "done"
    if state.discarded:
        state.tool_mask = [0] * len(state.tool_mask)  # out of the loss and its normaliser
    return state


async def continue_trajectories(
    states: Sequence[TrajectoryState],
    runners: Sequence[ToolRunner],
    seeds: Sequence[int],
    *,
    sampler: TurnSampler,
    rules: TrajectoryRules,
    stats: ToolStats,
) -> list[TrajectoryState]:
    """Every trajectory at once, each at its own pace, its turns from ``sampler``; in input order. The first error
    (the engine's, or a tool's content that this loop cannot carry) cancels the others and is raised as it is."""
    if not len(states) == len(runners) == len(seeds):
        raise ValueError("states, runners and seeds must have one entry per trajectory.")
    tasks = [
        asyncio.ensure_future(
            continue_trajectory(state, runner=runner, seed=seed, sampler=sampler, rules=rules, stats=stats)
        )
        for state, runner, seed in zip(states, runners, seeds, strict=True)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
