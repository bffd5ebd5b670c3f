"""A full-weight reload holds the requests at the servers, not the trajectories waiting on their tools
(rollout/request_gate.py), and a trajectory's turns after a reload carry the newer version
(agents/server_tool_sampler.py through VLLMServerClient.sample_turn)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from trlx_scale.agents.server_tool_sampler import ServerToolGroupSampler, TrajectoryTools, trajectory_summaries
from trlx_scale.agents.tool_call_continuation import ContinuationLimits, TrajectoryRules
from trlx_scale.generation.server_client import SamplingSettings, VLLMServerClient
from trlx_scale.rollout.async_producer import GroupRequest
from trlx_scale.rollout.request_gate import RequestGate

END = 2  # the end token of the fake turns below


def _loop_in_thread() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


async def _snapshot(events: list[str]) -> list[str]:
    return list(events)


def test_a_hold_waits_for_requests_at_the_server_and_none_starts_inside_it():
    gate = RequestGate()
    loop, thread = _loop_in_thread()
    events: list[str] = []

    async def request(name: str, seconds: float) -> None:
        async with gate.request():
            events.append(f"{name} sent")
            await asyncio.sleep(seconds)
            events.append(f"{name} answered")

    try:
        first = asyncio.run_coroutine_threadsafe(request("a", 0.3), loop)
        while gate.open_requests == 0:
            time.sleep(0.005)
        with gate.hold(timeout=10):
            assert events == ["a sent", "a answered"]  # the hold began after the request at the server returned
            second = asyncio.run_coroutine_threadsafe(request("b", 0.0), loop)
            # The loop runs ready tasks in the order they were scheduled: when this probe runs, "b" has taken its
            # first step, up to the gate.
            seen = asyncio.run_coroutine_threadsafe(_snapshot(events), loop).result(timeout=10)
            assert seen == ["a sent", "a answered"]  # nothing is sent while held
            events.append("reloaded")
        second.result(timeout=10)
        first.result(timeout=10)
        assert events == ["a sent", "a answered", "reloaded", "b sent", "b answered"]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def test_a_hold_that_the_requests_outlast_times_out_and_lets_requests_go_on():
    gate = RequestGate()
    loop, thread = _loop_in_thread()

    async def slow() -> None:
        async with gate.request():
            await asyncio.sleep(1.0)

    try:
        running = asyncio.run_coroutine_threadsafe(slow(), loop)
        while gate.open_requests == 0:
            time.sleep(0.005)
        with pytest.raises(TimeoutError, match="1 requests still at the server after 0 s"):
            with gate.hold(timeout=0.2):
                pass
        assert not gate.held  # the failed hold is released: requests are not blocked forever
        running.result(timeout=10)
        asyncio.run_coroutine_threadsafe(slow(), loop).result(timeout=10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


class _ScriptedServerClient(VLLMServerClient):
    """The real client with its HTTP call answered in-process: each turn is a tool call until the third, then an
    answer; the answer names the model asked for (what the client checks)."""

    def __init__(self):
        super().__init__(["http://replica-0"], "policy", SamplingSettings(max_tokens=8, temperature=1.0))
        self.sent_versions: list[int] = []

    async def _post_completion(self, url, body, what):
        self.sent_versions.append(self.full_weights_version)
        await asyncio.sleep(0.01)
        turn = 1 + sum(token == END for token in body["prompt"])  # each earlier turn ended on END
        ids = [10, END] if turn < 3 else [11, END]
        choices = [
            {"index": i, "text": "", "token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)}}
            for i in range(body.get("n", 1))
        ]
        return {"model": body["model"], "choices": choices}


def test_a_reload_lands_while_a_trajectory_waits_on_its_tool_and_its_next_turn_is_the_new_version():
    """The reload is not held by the tool (the tool returns only once the reload is done: a hold that waited for it
    would time out); the turn after it is sampled by, and tagged with, version 1."""
    client = _ScriptedServerClient()
    tool_started, tool_released = threading.Event(), threading.Event()

    def search(query: str) -> str:
        tool_started.set()
        assert tool_released.wait(timeout=30), "the tool was never released"
        return "found"

    def parse(ids, held, schema):
        if ids[0] == 10:
            return {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "search", "arguments": {"query": "q"}}}],
            }
        return {"role": "assistant", "content": "answer"}

    async def tools_for(request):
        return [TrajectoryTools(functions={"search": search}, schema=[]) for _ in range(request.num_generations)]

    executor = ThreadPoolExecutor(max_workers=4)
    sampler = ServerToolGroupSampler(
        client,
        tools_for=tools_for,
        rules=TrajectoryRules(
            limits=ContinuationLimits(max_completion_length=64, max_model_len=256, max_tool_calling_iterations=4),
            parse=parse,
            suffix_ids=lambda messages: [5, 6],
            tool_timeout=10.0,
        ),
        eos_token_ids=[END],
        executor=executor,
    )
    request = GroupRequest(
        index=0,
        prompt={"row": {"prompt": [{"role": "user", "content": "q"}]}, "prompt_ids": [1, 3]},
        num_generations=2,
        version=0,
        seed=7,
    )
    client.prompt_ids = lambda prompt: list(prompt["prompt_ids"])
    loop, thread = _loop_in_thread()
    try:
        future = asyncio.run_coroutine_threadsafe(sampler.sample(request), loop)
        assert tool_started.wait(timeout=10)
        with client.gate.hold(timeout=10):  # raises if it waits for the tool, which waits for the reload
            client.full_weights_version = 1  # the reload (what reload_weights / record_update set)
        tool_released.set()
        group = future.result(timeout=20)
    finally:
        tool_released.set()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        executor.shutdown(wait=False)
    assert group.version == 0  # admitted (and staleness counted) by the first turn
    assert [summary.turn_versions for summary in trajectory_summaries(group.extras)] == [(0, 1, 1), (0, 1, 1)]
    assert client.sent_versions == [0, 1, 1, 1, 1]  # one first-turn request, then two later turns per trajectory
    assert group.completion_ids[0] == [10, END, 5, 6, 10, END, 5, 6, 11, END]


def test_a_later_turn_never_goes_to_an_older_version_than_its_first():
    client = _ScriptedServerClient()
    client.full_weights_version = 2

    async def turn():
        return await client.sample_turn([1, 3, 10, END], 4, 0, version=3, replica=0)

    with pytest.raises(RuntimeError, match="versions went backwards"):
        asyncio.run(turn())
