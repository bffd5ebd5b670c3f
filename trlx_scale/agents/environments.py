"""One environment interface for every trainer: TRL's tool contracts as they are, and gym-style environments.

A multi-turn rollout talks to one ``AgentEnvironment`` per trajectory: ``reset`` gives the opening conversation,
``step`` answers each assistant turn with the messages to append (rendered into the context, never trained), an
optional per-turn reward and whether the episode is over, and ``final_reward`` is the environment's own score at
the end. Every call runs off the trainer's thread (the rollout's event loop; synchronous methods in a thread pool)
under a timeout, so a slow environment holds up only its own trajectory.

Two adapters make the environments users already have fit it, unchanged:

- ``ToolEnvironment``: TRL 1.16's contracts. ``tools=[fn, ...]`` and/or one instance of an ``environment_factory``:
  its public methods (plain functions of its class, except ``reset`` and ``get_reward``) become tools, ``reset(**row)``
  returns a string appended to the prompt's last message (or None), and ``get_reward()`` is a reward source, as in
  TRL (``environment_factory`` may be a dict that routes rows by their ``environment`` column: ``for_row``). An
  assistant turn with tool calls gets the tool messages back (``tool_runner``); one without ends the episode.
- ``GymEnvironment``: an object with ``reset(prompt, **row)`` returning the opening messages (or None to keep the
  dataset's prompt) and ``step(message)`` returning ``(observation, reward, done, info)`` (or an ``EnvironmentStep``),
  the observation a string (one user message) or a list of messages; SkyRL's and gymnasium's shape, for
  environments that are not tool sets (games, simulators, judges that answer in text).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

from .tool_runner import CallTimeout, ToolRunner, ToolStats, bounded_call

RESERVED_METHODS = ("reset", "get_reward")


@dataclasses.dataclass
class EnvironmentStep:
    """An environment's answer to one assistant turn."""

    messages: list[dict[str, Any]]  # appended to the conversation: in the context, out of the loss
    reward: float | None = None  # this turn's reward, if the environment gives per-turn rewards
    done: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class AgentEnvironment(Protocol):
    """What a multi-turn rollout calls (see the module docstring)."""

    tools: list[Callable[..., Any]]  # rendered into the prompt by the chat template (TRL's ``tools``); [] for none
    tool_stats: ToolStats

    async def reset(self, prompt: list[dict[str, Any]], row: dict[str, Any]) -> list[dict[str, Any]]: ...

    async def step(self, message: dict[str, Any]) -> EnvironmentStep: ...

    async def final_reward(self) -> float | None: ...

    def close(self) -> None: ...


class EnvironmentTimeout(TimeoutError):
    """An environment's ``reset``, ``step`` or ``get_reward`` took longer than its timeout."""


async def _call(
    function: Callable[..., Any], executor: ThreadPoolExecutor, timeout: float, what: str, *args, **kwargs
) -> Any:
    """``function(*args, **kwargs)`` off the loop's thread, bounded (``tool_runner.bounded_call``)."""
    try:
        return await bounded_call(function, executor, timeout, *args, **kwargs)
    except CallTimeout:
        raise EnvironmentTimeout(f"{what} took longer than {timeout:g} s (environment_timeout).") from None


async def _get_reward(environment: Any, executor: ThreadPoolExecutor, timeout: float) -> float | None:
    """The environment's ``get_reward()`` (TRL's reward source), None when it has none."""
    get_reward = getattr(environment, "get_reward", None)
    if get_reward is None:
        return None
    return await _call(get_reward, executor, timeout, f"{type(environment).__name__}.get_reward")


def environment_tools(instance: Any) -> list[Callable[..., Any]]:
    """An ``environment_factory`` instance's tools as TRL finds them: the plain functions of its class not starting
    with ``_``, except ``reset`` and ``get_reward``, bound to the instance."""
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if not name.startswith("_") and name not in RESERVED_METHODS
    ]


def _append_to_last_message(prompt: list[dict[str, Any]], observation: Any) -> list[dict[str, Any]]:
    """TRL's reset rule: the observation is appended to the last message's content, with no separator."""
    last = dict(prompt[-1])
    content = last.get("content", "")
    if isinstance(observation, list):
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        last["content"] = blocks + observation
    elif isinstance(content, list):
        last["content"] = [*content, {"type": "text", "text": str(observation)}]
    else:
        last["content"] = content + str(observation)
    return [*prompt[:-1], last]


class ToolEnvironment:
    """TRL's ``tools`` and ``environment_factory`` contracts as an ``AgentEnvironment`` (module docstring)."""

    def __init__(
        self,
        tools: list[Callable[..., Any]] | None = None,
        instance: Any = None,
        tool_timeout: float = 60.0,
        environment_timeout: float = 60.0,
        executor: ThreadPoolExecutor | None = None,
    ):
        if instance is not None and not callable(getattr(instance, "reset", None)):
            raise TypeError(
                "Each environment instance returned by `environment_factory` must define a callable `reset` "
                f"({type(instance).__name__} does not)."
            )
        self.instance = instance
        self.tools = list(tools or []) + (environment_tools(instance) if instance is not None else [])
        self._executor = executor or ThreadPoolExecutor(max_workers=4, thread_name_prefix="trlx-scale-env")
        self._own_executor = executor is None
        self.runner = ToolRunner({tool.__name__: tool for tool in self.tools}, tool_timeout, executor=self._executor)
        self.environment_timeout = environment_timeout
        self.tool_stats = ToolStats()

    @classmethod
    def for_row(
        cls,
        row: dict[str, Any],
        tools: list[Callable[..., Any]] | None = None,
        environment_factory: Callable[[], Any] | dict[str, Callable[[], Any]] | None = None,
        **options: Any,
    ) -> ToolEnvironment:
        """The environment of one dataset row: a new instance of its factory (routed by the row's ``environment``
        column when ``environment_factory`` is a dict, as in TRL)."""
        factory = environment_factory
        if isinstance(environment_factory, dict):
            name = row.get("environment")
            if name not in environment_factory:
                raise ValueError(
                    f"Example has `environment={name!r}`, which is not among the environments passed to "
                    f"`environment_factory`. Expected one of: {list(environment_factory)}."
                )
            factory = environment_factory[name]
        return cls(tools=tools, instance=factory() if factory is not None else None, **options)

    async def reset(self, prompt: list[dict[str, Any]], row: dict[str, Any]) -> list[dict[str, Any]]:
        prompt = copy.deepcopy(prompt)
        if self.instance is None:
            return prompt
        arguments = {key: value for key, value in row.items() if key != "environment"}
        what = f"{type(self.instance).__name__}.reset"
        observation = await _call(self.instance.reset, self._executor, self.environment_timeout, what, **arguments)
        return prompt if observation is None else _append_to_last_message(prompt, observation)

    async def step(self, message: dict[str, Any]) -> EnvironmentStep:
        calls = message.get("tool_calls") or []
        if not calls:
            return EnvironmentStep(messages=[], done=True)
        results = await self.runner.run(calls)
        for result in results:
            self.tool_stats.record(result)
        return EnvironmentStep(
            messages=[result.message for result in results],
            info={"tool_outcomes": [result.outcome.value for result in results]},
        )

    async def final_reward(self) -> float | None:
        return await _get_reward(self.instance, self._executor, self.environment_timeout)

    def close(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)


class GymEnvironment:
    """A gym-style environment (``reset`` / ``step``) as an ``AgentEnvironment`` (module docstring)."""

    def __init__(
        self,
        environment: Any,
        environment_timeout: float = 60.0,
        executor: ThreadPoolExecutor | None = None,
    ):
        for name in ("reset", "step"):
            if not callable(getattr(environment, name, None)):
                raise TypeError(f"a gym-style environment needs a callable `{name}` ({type(environment).__name__}).")
        self.environment = environment
        self.tools: list[Callable[..., Any]] = list(getattr(environment, "tools", None) or [])
        self.tool_stats = ToolStats()
        self.environment_timeout = environment_timeout
        self._executor = executor or ThreadPoolExecutor(max_workers=4, thread_name_prefix="trlx-scale-env")
        self._own_executor = executor is None

    async def reset(self, prompt: list[dict[str, Any]], row: dict[str, Any]) -> list[dict[str, Any]]:
        what = f"{type(self.environment).__name__}.reset"
        arguments = {key: value for key, value in row.items() if key != "prompt"}
        opening = await _call(
            self.environment.reset, self._executor, self.environment_timeout, what, copy.deepcopy(prompt), **arguments
        )
        return copy.deepcopy(prompt) if opening is None else list(opening)

    async def step(self, message: dict[str, Any]) -> EnvironmentStep:
        what = f"{type(self.environment).__name__}.step"
        answer = await _call(self.environment.step, self._executor, self.environment_timeout, what, message)
        if isinstance(answer, EnvironmentStep):
            return answer
        try:
            observation, reward, done, info = answer
        except (TypeError, ValueError):
            raise TypeError(
                f"{what} must return an EnvironmentStep or (observation, reward, done, info), got {answer!r}."
            ) from None
        if observation is None:
            messages = []
        elif isinstance(observation, str):
            messages = [{"role": "user", "content": observation}]
        else:
            messages = list(observation)
        return EnvironmentStep(
            messages=messages, reward=None if reward is None else float(reward), done=bool(done), info=dict(info or {})
        )

    async def final_reward(self) -> float | None:
        return await _get_reward(self.environment, self._executor, self.environment_timeout)

    def close(self) -> None:
        close = getattr(self.environment, "close", None)
        if callable(close):
            close()
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
