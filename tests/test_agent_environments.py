"""agents/: tool calls run concurrently off the trainer's thread, each under a timeout, failures counted apart and
handed back as TRL's tool messages; TRL's environment contracts and gym-style environments behind one interface."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from trlx_scale.agents import EnvironmentStep, GymEnvironment, ToolEnvironment, ToolRunner, ToolStats
from trlx_scale.agents.environments import EnvironmentTimeout
from trlx_scale.agents.tool_runner import ToolOutcome


def _call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _run(runner, calls):
    return asyncio.run(runner.run(calls))


def test_a_turns_synchronous_tools_run_at_the_same_time():
    """Each tool waits at a barrier of two: the turn finishes only if both run at once (TRL runs them one by one)."""
    barrier = threading.Barrier(2, timeout=10)

    def search(query: str) -> str:
        barrier.wait()
        return f"results for {query}"

    runner = ToolRunner({"search": search}, timeout=20)
    results = _run(runner, [_call("search", query="a"), _call("search", query="b")])
    assert [r.message for r in results] == [
        {"role": "tool", "name": "search", "content": "results for a"},
        {"role": "tool", "name": "search", "content": "results for b"},
    ]
    assert all(r.outcome is ToolOutcome.OK for r in results)
    runner.close()


def test_failures_are_counted_apart_and_handed_back_as_trls_tool_errors():
    def divide(a: int, b: int) -> float:
        return a / b

    runner = ToolRunner({"divide": divide}, timeout=5)
    results = _run(
        runner,
        [
            _call("divide", a=1, b=0),  # raises
            _call("nope", x=1),  # unknown
            _call("divide", a=1),  # a missing argument
            {"type": "function", "function": {"name": "divide", "arguments": '{"a": 6, "b": 3}'}},  # JSON text
            {"type": "retrieval"},
            "divide(1, 2)",  # not a parsed call at all
        ],
    )
    outcomes = [r.outcome for r in results]
    assert outcomes == [
        ToolOutcome.RAISED,
        ToolOutcome.UNKNOWN,
        ToolOutcome.BAD_CALL,
        ToolOutcome.OK,
        ToolOutcome.BAD_CALL,
        ToolOutcome.BAD_CALL,
    ]
    assert results[0].message == {"role": "tool", "name": "divide", "content": "{'error': 'division by zero'}"}
    assert results[1].message["content"] == "{'error': 'Tool nope not found.'}"  # TRL's words
    assert "does not take the arguments ['a']" in results[2].message["content"]
    assert results[3].message["content"] == "2.0"
    stats = ToolStats()
    for result in results:
        stats.record(result)
    metrics = stats.as_metrics()
    assert metrics["tools/calls"] == 6 and metrics["tools/raised"] == 1 and metrics["tools/unknown"] == 1
    assert metrics["tools/bad_call"] == 3 and metrics["tools/timeout"] == 0
    assert metrics["tools/failure_frequency"] == pytest.approx(5 / 6)
    runner.close()


def test_a_hung_tool_times_out_without_holding_the_others():
    release = threading.Event()
    cancelled = []

    def hangs() -> str:
        release.wait(30)
        return "late"

    async def hangs_async() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return "late"

    def quick() -> str:
        return "fast"

    runner = ToolRunner({"hangs": hangs, "hangs_async": hangs_async, "quick": quick}, timeout=0.3)
    results = _run(runner, [_call("hangs"), _call("hangs_async"), _call("quick")])
    release.set()
    assert [r.outcome for r in results] == [ToolOutcome.TIMEOUT, ToolOutcome.TIMEOUT, ToolOutcome.OK]
    assert results[0].message["content"] == "{'error': 'Tool hangs timed out after 0.3 s.'}"
    assert cancelled == [True]  # a coroutine tool is cancelled at its timeout
    runner.close()


class _Calculator:
    """A TRL environment_factory environment, as a TRL user writes it."""

    def reset(self, **row) -> str | None:
        self.target = row["answer"]
        self.calls = 0
        return " (you may use the calculator)"

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return 1.0 if self.calls else 0.0

    def _private(self) -> None:
        raise AssertionError("not a tool")


def test_a_trl_environment_runs_unchanged():
    environment = ToolEnvironment.for_row({"answer": "5"}, environment_factory=_Calculator, tool_timeout=5)
    assert [tool.__name__ for tool in environment.tools] == ["add"]  # public methods; reset, get_reward, _private not
    prompt = [{"role": "user", "content": "2+3="}]
    opening = asyncio.run(environment.reset(prompt, {"prompt": prompt, "answer": "5"}))
    assert opening == [{"role": "user", "content": "2+3= (you may use the calculator)"}]
    assert prompt == [{"role": "user", "content": "2+3="}]  # the dataset's prompt is not modified
    step = asyncio.run(environment.step({"role": "assistant", "content": "", "tool_calls": [_call("add", a=2, b=3)]}))
    assert step == EnvironmentStep(
        messages=[{"role": "tool", "name": "add", "content": "5"}], info={"tool_outcomes": ["ok"]}
    )
    assert asyncio.run(environment.step({"role": "assistant", "content": "5"})).done
    assert asyncio.run(environment.final_reward()) == 1.0
    assert environment.tool_stats.calls == 1
    environment.close()


def test_rows_route_to_their_environment_and_an_unknown_one_is_named():
    factories = {"calculator": _Calculator}
    environment = ToolEnvironment.for_row({"environment": "calculator", "answer": "1"}, environment_factory=factories)
    assert isinstance(environment.instance, _Calculator)
    environment.close()
    with pytest.raises(ValueError, match=r"`environment='chess'`, which is not among.*\['calculator'\]"):
        ToolEnvironment.for_row({"environment": "chess"}, environment_factory=factories)
    with pytest.raises(TypeError, match="must define a callable `reset`"):
        ToolEnvironment(instance=object())


class _GuessTheNumber:
    """A gym-style environment: text in, text out, a reward per turn."""

    def reset(self, prompt, **row):
        self.secret = int(row["secret"])
        return [{"role": "user", "content": "Guess a number from 1 to 9."}]

    def step(self, message):
        guess = int(message["content"])
        if guess == self.secret:
            return "Correct.", 1.0, True, {"guess": guess}
        return ("Higher." if guess < self.secret else "Lower."), 0.0, False, {"guess": guess}


def test_a_gym_environment_answers_in_messages_rewards_and_done():
    environment = GymEnvironment(_GuessTheNumber())
    opening = asyncio.run(environment.reset([{"role": "user", "content": "ignored"}], {"secret": "7"}))
    assert opening == [{"role": "user", "content": "Guess a number from 1 to 9."}]
    step = asyncio.run(environment.step({"role": "assistant", "content": "3"}))
    assert step == EnvironmentStep([{"role": "user", "content": "Higher."}], reward=0.0, done=False, info={"guess": 3})
    assert asyncio.run(environment.step({"role": "assistant", "content": "7"})).done
    assert asyncio.run(environment.final_reward()) is None
    environment.close()


def test_a_gym_environment_that_hangs_or_answers_wrongly_is_named():
    class Hangs(_GuessTheNumber):
        def step(self, message):
            time.sleep(2)

    class Mumbles(_GuessTheNumber):
        def step(self, message):
            return "no tuple"

    hung = GymEnvironment(Hangs(), environment_timeout=0.2)
    with pytest.raises(EnvironmentTimeout, match="Hangs.step took longer than 0.2 s"):
        asyncio.run(hung.step({"role": "assistant", "content": "1"}))
    hung.close()
    with pytest.raises(TypeError, match=r"Mumbles.step must return an EnvironmentStep or \(observation"):
        asyncio.run(GymEnvironment(Mumbles()).step({"role": "assistant", "content": "1"}))
