"""A turn's tool calls, run off the trainer's thread: concurrently, each under a timeout, never a crash or a hang.

TRL 1.16's loop runs synchronous tools one after another on the trainer's thread, so one slow tool holds every
trajectory of the batch and a hung one holds the run forever. Here each call of a turn is a task on the caller's
event loop: a coroutine tool is awaited, a synchronous one runs in a thread pool, and each is bounded by
``timeout`` seconds (``asyncio.wait_for``; cancelling the turn cancels its calls).

A failure reaches the model as TRL hands it one, so a TRL user's environment learns from the same messages: the tool
message ``{"role": "tool", "name": name, "content": str(result)}``, with ``result = {"error": ...}`` for an unknown
tool (``"Tool X not found."``, TRL's words), a tool that raised (its message), a call past its timeout, or arguments
the tool does not take. The outcomes are counted apart (``ToolStats``): TRL counts them as one "failure".

A synchronous tool that passes its timeout cannot be stopped (Python does not kill threads): its thread runs on and
its result is dropped. ``max_workers`` bounds how many threads such tools can hold; give slow synchronous tools a
timeout of their own, or write them as coroutines, which are cancelled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import inspect
import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class ToolOutcome(str, enum.Enum):
    OK = "ok"
    RAISED = "raised"  # the tool raised an exception
    UNKNOWN = "unknown"  # no tool of that name
    TIMEOUT = "timeout"  # past ``timeout`` seconds
    BAD_CALL = "bad_call"  # not a function call, or arguments that are not a JSON object


@dataclasses.dataclass(frozen=True)
class ToolCallResult:
    """One call's tool message (what the model reads next), its outcome and its wall time."""

    name: str
    message: dict[str, Any]
    outcome: ToolOutcome
    seconds: float


@dataclasses.dataclass
class ToolStats:
    """Counts and latencies of tool calls, merged across trajectories (``as_metrics`` for the trainer's logs)."""

    calls: int = 0
    outcomes: dict[str, int] = dataclasses.field(default_factory=lambda: {outcome.value: 0 for outcome in ToolOutcome})
    seconds_total: float = 0.0
    seconds_max: float = 0.0

    def record(self, result: ToolCallResult) -> None:
        self.calls += 1
        self.outcomes[result.outcome.value] += 1
        self.seconds_total += result.seconds
        self.seconds_max = max(self.seconds_max, result.seconds)

    def merge(self, other: ToolStats) -> None:
        self.calls += other.calls
        for name, count in other.outcomes.items():
            self.outcomes[name] = self.outcomes.get(name, 0) + count
        self.seconds_total += other.seconds_total
        self.seconds_max = max(self.seconds_max, other.seconds_max)

    @property
    def failures(self) -> int:
        return self.calls - self.outcomes[ToolOutcome.OK.value]

    def as_metrics(self) -> dict[str, float]:
        """``tools/calls``, each failure kind (``tools/raised``, ``tools/unknown``, ``tools/timeout``,
        ``tools/bad_call``), ``tools/failure_frequency`` (TRL's name: failures per call) and the latency."""
        metrics = {"tools/calls": float(self.calls)}
        for outcome in ToolOutcome:
            if outcome is not ToolOutcome.OK:
                metrics[f"tools/{outcome.value}"] = float(self.outcomes[outcome.value])
        metrics["tools/failure_frequency"] = self.failures / self.calls if self.calls else 0.0
        metrics["tools/latency_mean_s"] = self.seconds_total / self.calls if self.calls else 0.0
        metrics["tools/latency_max_s"] = self.seconds_max
        return metrics


def _error(text: str) -> str:
    return str({"error": text})  # TRL's tool-error content: the dict's repr


class CallTimeout(TimeoutError):
    """A bounded call (``bounded_call``) did not return within its timeout."""


async def bounded_call(
    function: Callable[..., Any], executor: ThreadPoolExecutor, timeout: float, *args: Any, **kwargs: Any
) -> Any:
    """``function(*args, **kwargs)``: awaited if it is a coroutine function, else run in ``executor``; raises
    ``CallTimeout`` after ``timeout`` seconds (the call is cancelled; a thread's result is dropped), and the
    function's own exceptions as they are. ``asyncio.wait``, not ``wait_for``: a ``TimeoutError`` the function raises
    itself is its own error, not a timeout."""
    if inspect.iscoroutinefunction(function):
        task = asyncio.ensure_future(function(*args, **kwargs))
    else:
        task = asyncio.get_running_loop().run_in_executor(executor, functools.partial(function, *args, **kwargs))
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:  # the caller was cancelled: so is its call
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise CallTimeout(f"timed out after {timeout:g} s")
    return task.result()


class ToolRunner:
    """Runs tool calls (TRL's parsed ``tool_calls``) against ``tools``, a name -> callable mapping."""

    def __init__(
        self,
        tools: dict[str, Callable[..., Any]],
        timeout: float = 60.0,
        max_workers: int = 16,
        executor: ThreadPoolExecutor | None = None,
    ):
        if not timeout > 0:
            raise ValueError(f"tool_timeout must be positive seconds, got {timeout}.")
        self.tools = dict(tools)
        self.timeout = timeout
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="trlx-scale-tool")

    async def run(self, tool_calls: Sequence[dict[str, Any]]) -> list[ToolCallResult]:
        """Every call of one turn at once; the results in the calls' order."""
        return list(await asyncio.gather(*(self._run_one(call) for call in tool_calls)))

    async def _run_one(self, call: dict[str, Any]) -> ToolCallResult:
        began = time.perf_counter()
        name, outcome, result = self._name_of(call), ToolOutcome.OK, None
        function = call.get("function") if isinstance(call, dict) else None
        kind = call.get("type", "function") if isinstance(call, dict) else type(call).__name__
        if kind != "function" or not isinstance(function, dict):
            outcome, result = ToolOutcome.BAD_CALL, _error(f"Unsupported tool call type: {kind}")
        elif name not in self.tools:
            outcome, result = ToolOutcome.UNKNOWN, _error(f"Tool {name} not found.")
        else:
            arguments = function.get("arguments") or {}
            if isinstance(arguments, str):  # some parsers leave the JSON text
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError as error:
                    arguments = error
            if not isinstance(arguments, dict):
                outcome, result = ToolOutcome.BAD_CALL, _error(f"Tool {name} takes a JSON object of arguments.")
            else:
                outcome, result = await self._call(name, self.tools[name], arguments)
        content = result if isinstance(result, list) else str(result)  # a list: content blocks, as TRL keeps them
        message = {"role": "tool", "name": name, "content": content}
        return ToolCallResult(name, message, outcome, time.perf_counter() - began)

    async def _call(self, name: str, tool: Callable[..., Any], arguments: dict[str, Any]) -> tuple[ToolOutcome, Any]:
        if _is_signature_error(tool, arguments):
            return ToolOutcome.BAD_CALL, _error(f"Tool {name} does not take the arguments {sorted(arguments)}.")
        try:
            return ToolOutcome.OK, await bounded_call(tool, self._executor, self.timeout, **arguments)
        except CallTimeout:
            return ToolOutcome.TIMEOUT, _error(f"Tool {name} timed out after {self.timeout:g} s.")
        except Exception as error:  # noqa: BLE001 - any tool failure goes back to the model, as in TRL
            return ToolOutcome.RAISED, _error(str(error))

    @staticmethod
    def _name_of(call: Any) -> str:
        function = call.get("function") if isinstance(call, dict) else None
        return str(function.get("name")) if isinstance(function, dict) else "unknown"

    def close(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)


def _is_signature_error(tool: Callable[..., Any], arguments: dict[str, Any]) -> bool:
    """Whether ``tool`` cannot take ``arguments`` (a model's call with a wrong or missing argument)."""
    try:
        signature = inspect.signature(tool)
    except ValueError:  # no signature (some builtins): the call itself will tell
        return False
    try:
        signature.bind(**arguments)
    except TypeError:
        return True
    return False
