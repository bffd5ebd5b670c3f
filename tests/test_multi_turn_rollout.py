"""agents/multi_turn_rollout.py: trajectories advance each at its own pace (a slow tool holds only its own), turns
are bounded by the budgets, a cut-off turn runs no tool, and every turn is token-in/token-out."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest

from trlx_scale.agents import ToolEnvironment
from trlx_scale.agents.multi_turn_rollout import SampledTurn, run_trajectories, trajectory_metrics
from trlx_scale.agents.tool_runner import ToolOutcome
from trlx_scale.agents.trajectory_tokens import ObservationRenderer, TurnBudget

from .test_trajectory_tokens import TOOL_TEMPLATE

CALL = re.compile(r"<call>(\w+)\((.*?)\)</call>")


class ScriptedSampler:
    """Each task's turns, in order: the task is the prompt's user text; every request is recorded."""

    def __init__(self, tokenizer, scripts, finish=None):
        self.tokenizer, self.scripts, self.finish = tokenizer, {k: list(v) for k, v in scripts.items()}, finish or {}
        self.requests = []

    async def sample(self, prompt_ids, max_tokens, seed, turn):
        text = self.tokenizer.decode(prompt_ids)
        task = re.match(r"<\|user\|>(\w+)", text).group(1)
        self.requests.append((task, len(prompt_ids), max_tokens))
        await asyncio.sleep(0)  # a real engine answers later: let the others run
        reply = self.scripts[task].pop(0)
        ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"]
        reason = self.finish.get(task, "stop")
        return SampledTurn(ids=ids, logprobs=[-0.25] * len(ids), finish_reason=reason)


def _parser(tokenizer):
    def parse(ids):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        calls = [
            {"type": "function", "function": {"name": name, "arguments": json.loads(arguments)}}
            for name, arguments in CALL.findall(text)
        ]
        message = {"role": "assistant", "content": CALL.sub("", text)}
        return {**message, "tool_calls": calls} if calls else message

    return parse


def _run(tokenizer, sampler, environments, budget, tasks):
    return asyncio.run(
        run_trajectories(
            prompts=[[{"role": "user", "content": task}] for task in tasks],
            rows=[{"task": task} for task in tasks],
            environments=environments,
            seeds=[0] * len(tasks),
            sampler=sampler,
            renderer=ObservationRenderer(tokenizer, chat_template=TOOL_TEMPLATE),
            parse=_parser(tokenizer),
            budget=budget,
            tokenizer=tokenizer,
        )
    )


def test_a_slow_tool_holds_only_its_own_trajectory(default_tokenizer):
    """A's one tool call waits until B has finished three tool rounds and its answer: in lockstep (every turn waits
    for the batch) B could not pass its first round while A's tool runs, and A's tool would time out."""
    b_finished = threading.Event()

    def slow_lookup(key: str) -> str:
        if not b_finished.wait(10):
            raise TimeoutError("B never finished: the trajectories ran in lockstep")
        return f"value of {key}"

    def fast_add(a: int, b: int) -> int:
        return a + b

    class SignallingSampler(ScriptedSampler):
        async def sample(self, prompt_ids, max_tokens, seed, turn):
            sampled = await super().sample(prompt_ids, max_tokens, seed, turn)
            if self.requests[-1][0] == "B" and not self.scripts["B"]:
                b_finished.set()
            return sampled

    sampler = SignallingSampler(
        default_tokenizer,
        {
            "A": ['<call>slow_lookup({"key": "x"})</call><|end|>', "done<|end|>"],
            "B": [f'<call>fast_add({{"a": {i}, "b": 1}})</call><|end|>' for i in range(3)] + ["4<|end|>"],
        },
    )
    environments = [
        ToolEnvironment(tools=[slow_lookup], tool_timeout=20),
        ToolEnvironment(tools=[fast_add], tool_timeout=20),
    ]
    a, b = _run(default_tokenizer, sampler, environments, TurnBudget(200, 256), ["A", "B"])
    assert environments[0].tool_stats.outcomes[ToolOutcome.OK.value] == 1  # the slow tool returned, in time
    assert (a.tool_rounds, b.tool_rounds) == (1, 3) and a.stop_reason == b.stop_reason == "done"
    assert a.completion[1] == {"role": "tool", "name": "slow_lookup", "content": "value of x"}
    # B's four turns were all sampled before A's second: nobody waited for the batch.
    order = [task for task, _, _ in sampler.requests]
    assert order.index("A", 1) > max(i for i, task in enumerate(order) if task == "B")
    for environment in environments:
        environment.close()


def test_turns_continue_the_held_ids_within_the_budgets(default_tokenizer):
    def echo(text: str) -> str:
        return text * 10  # a long answer: cut to max_tool_response_tokens

    sampler = ScriptedSampler(default_tokenizer, {"C": ['<call>echo({"text": "ab"})</call><|end|>', "ok<|end|>"]})
    budget = TurnBudget(max_completion_length=120, max_model_len=200, max_turn_tokens=64, max_tool_response_tokens=6)
    (trajectory,) = _run(default_tokenizer, sampler, [ToolEnvironment(tools=[echo])], budget, ["C"])
    tokens = trajectory.tokens
    assert trajectory.completion[1]["content"] == "ababab" and trajectory.truncated_tool_responses == 1
    # Turn 2 was asked to continue exactly the held ids: prompt + turn 1 + the observation.
    (_, first_context, first_max), (_, second_context, second_max) = sampler.requests
    assert second_context == len(tokens.prompt_ids) + tokens.loss_mask.index(0) + tokens.loss_mask.count(0)
    assert first_max == 64 and second_max == min(64, 120 - (second_context - first_context))
    observation = default_tokenizer("<tool>ababab<|assistant|>", add_special_tokens=False)["input_ids"]
    first = tokens.loss_mask.index(0)
    assert tokens.completion_ids[first : first + len(observation)] == observation
    assert tokens.loss_mask == [1] * first + [0] * len(observation) + [1] * (
        len(tokens.loss_mask) - first - len(observation)
    )
    assert trajectory.prefix_mismatches == 0


def test_a_cut_off_turn_runs_no_tool_and_tool_rounds_are_capped(default_tokenizer):
    calls = []

    def record(x: int) -> int:
        calls.append(x)
        return x

    call = '<call>record({"x": 1})</call><|end|>'
    cut = ScriptedSampler(default_tokenizer, {"D": [call]}, finish={"D": "length"})
    (trajectory,) = _run(default_tokenizer, cut, [ToolEnvironment(tools=[record])], TurnBudget(200, 256), ["D"])
    assert trajectory.stop_reason == "length" and calls == [] and not trajectory.stopped_cleanly
    capped = ScriptedSampler(default_tokenizer, {"E": [call, call, call]})
    budget = TurnBudget(200, 256, max_tool_calling_iterations=2)
    (trajectory,) = _run(default_tokenizer, capped, [ToolEnvironment(tools=[record])], budget, ["E"])
    assert trajectory.stop_reason == "tool_rounds" and calls == [1, 1] and trajectory.tool_rounds == 2


def test_a_context_that_would_overflow_ends_before_the_engine_refuses_it(default_tokenizer):
    """prompt + max_tokens never exceeds max_model_len (vLLM rejects such a request); an answer that leaves no room
    ends the trajectory on its call."""

    def big(n: int) -> str:
        return "z" * n

    sampler = ScriptedSampler(default_tokenizer, {"F": ['<call>big({"n": 40})</call><|end|>', "never<|end|>"]})
    budget = TurnBudget(max_completion_length=200, max_model_len=60)
    (trajectory,) = _run(default_tokenizer, sampler, [ToolEnvironment(tools=[big])], budget, ["F"])
    assert trajectory.stop_reason == "budget" and len(sampler.requests) == 1
    (_, context, max_tokens) = sampler.requests[0]
    assert context + max_tokens <= 60
    metrics = trajectory_metrics([trajectory])
    assert metrics["agents/stopped_budget_frac"] == 1.0 and metrics["agents/turns_mean"] == 1.0


def test_an_environment_error_stops_the_batch_at_once_and_cancels_the_others(default_tokenizer):
    """One trajectory's environment raises: run_trajectories raises that error as it is, and the trajectory still
    waiting on a slow environment is cancelled (not left running until its minute is up)."""
    from trlx_scale.agents import GymEnvironment

    cancelled = []

    class Broken:
        def reset(self, prompt, **row):
            return None

        def step(self, message):
            raise RuntimeError("the simulator crashed")

    class Slow:
        def reset(self, prompt, **row):
            return None

        async def step(self, message):
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

    sampler = ScriptedSampler(default_tokenizer, {"G": ["a<|end|>"], "H": ["b<|end|>"]})
    environments = [GymEnvironment(Broken()), GymEnvironment(Slow())]
    with pytest.raises(RuntimeError, match="^the simulator crashed$"):
        _run(default_tokenizer, sampler, environments, TurnBudget(50, 100), ["G", "H"])
    assert cancelled == [True]
