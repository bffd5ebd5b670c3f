"""TRL's per-batch environment and tool state, prepared by trlx_scale's rollout collector.

Why: TRL 1.16's ``GRPOTrainer`` keeps ``environment_factory``'s instances in a pool on the trainer
(``_environment_pool[name]``, handed out in order from index 0 each batch, grown with the factory when a batch needs
more), and its generation driver (``_generate``, ``_tokenize_prompts``, ``_tool_call_loop``, ``_calculate_rewards``)
reads per-batch state that TRL's ``_generate_and_score_completions`` writes before it: the batch's instances
(``environments``), their names (``_batch_environments``, for the tool schema each prompt is rendered with) and each
rollout's tool functions (``_sync_tool_dicts`` / ``_async_tool_dicts``: the standalone tools plus the public methods
of its environment). trlx_scale collects rollouts itself (``rollout.collector``) and calls TRL's driver, so it writes
that state as TRL would; TRL has no public hook for it.

Also here: the resets. TRL resets each instance in a loop on the trainer's thread; ``run_resets`` runs them all at
once, each in a thread of its own under a timeout (``tool_scheduling="concurrent"``).

Covered: TRL 1.16 (checked: 1.16.0). ``tests/test_trl_contract.py`` fails when the lines this mirrors change.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import threading
from collections import Counter
from typing import Any

import trl

TESTED_TRL = ("1.16",)


def empty_prompt() -> list[dict[str, str]]:
    """TRL's placeholder prompt for a row without one when an environment owns the data (its reset supplies the
    prompt); a new list per row, as TRL's."""
    return [{"role": "user", "content": ""}]


class EnvironmentResetTimeout(TimeoutError):
    """An environment's ``reset`` did not return within ``tool_timeout``."""


def supported() -> bool:
    """Whether this TRL is one whose environment state this module was checked against."""
    return trl.__version__.startswith(TESTED_TRL)


def environment_names(trainer: Any, rows: list[dict]) -> list[Any]:
    """Each row's environment name (None with a single factory). A row naming an environment that is not among the
    factories raises TRL's error."""
    names = [row.get("environment") if trainer._multi_environment else None for row in rows]
    for name in dict.fromkeys(names):
        if name not in trainer.environment_factories:
            raise ValueError(
                f"Example has `environment={name!r}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(trainer.environment_factories)}."
            )
    return names


def draw_like_trl(trainer: Any, rows: list[dict]) -> list[Any]:
    """The environment instances for ``rows``, from TRL's pool as TRL hands them out (growing it as TRL would).
    An unknown environment raises before any pool grows."""
    names = environment_names(trainer, rows)
    drawn, handed = [], Counter()
    for name in names:
        pool = trainer._environment_pool[name]
        if handed[name] == len(pool):
            pool.append(trainer.environment_factories[name]())
        drawn.append(pool[handed[name]])
        handed[name] += 1
    return drawn


def tool_dicts(trainer: Any, count: int) -> tuple[list[dict], list[dict]]:
    """Each rollout's tools by name, synchronous and asynchronous apart (TRL's rule: the standalone tools, then the
    public methods of the rollout's environment other than ``reset`` and ``get_reward``)."""
    sync_dicts, async_dicts = [], []
    for index in range(count):
        methods = []
        if trainer.environments:
            environment = trainer.environments[index]
            methods = [
                getattr(environment, name)
                for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
                if name not in ("reset", "get_reward") and not name.startswith("_")
            ]
        sync_tools, async_tools = {}, {}
        for tool in trainer._standalone_tools + methods:
            (async_tools if inspect.iscoroutinefunction(tool) else sync_tools)[tool.__name__] = tool
        sync_dicts.append(sync_tools)
        async_dicts.append(async_tools)
    return sync_dicts, async_dicts


def reset_arguments(row: dict, multi_environment: bool) -> dict:
    """TRL's rule: in multi-environment mode ``environment`` is a routing field, not a reset argument."""
    return {k: v for k, v in row.items() if k != "environment"} if multi_environment else row


def with_observation(prompt: list, observation: Any) -> list:
    """The prompt with a reset's observation appended to its last message's content (TRL's rule: text and content
    blocks are converted to match); a new list, the row's own prompt left as it was."""
    if observation is None:
        return prompt
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]


def run_resets(environments: list[Any], arguments: list[dict], timeout: float) -> list[Any]:
    """Every ``environment.reset(**kwargs)`` at once, each in a thread of its own; their observations in order. A
    reset's own error is raised as it is; one still running after ``timeout`` seconds raises
    ``EnvironmentResetTimeout``: its thread (a daemon, so that it does not hold the interpreter's exit) is abandoned
    and its result dropped."""
    futures = [concurrent.futures.Future() for _ in environments]

    def reset(future: concurrent.futures.Future, environment: Any, kwargs: dict) -> None:
        try:
            future.set_result(environment.reset(**kwargs))
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            future.set_exception(error)

    for index, (future, environment, kwargs) in enumerate(zip(futures, environments, arguments, strict=True)):
        name = f"trlx-scale-reset-{index}"
        threading.Thread(target=reset, args=(future, environment, kwargs), name=name, daemon=True).start()
    done, pending = concurrent.futures.wait(futures, timeout=timeout, return_when="FIRST_EXCEPTION")
    for future in futures:  # the first failure in batch order, for a message that does not depend on timing
        if future in done and future.exception() is not None:
            raise future.exception()
    if pending:
        name = type(environments[futures.index(next(iter(pending)))]).__name__
        raise EnvironmentResetTimeout(
            f"{len(pending)} of {len(futures)} {name}.reset calls did not return within tool_timeout={timeout:g} s. "
            "Make reset faster or raise tool_timeout."
        )
    return [future.result() for future in futures]
