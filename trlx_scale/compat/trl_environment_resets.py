"""Environment resets off the trainer's thread, for TRL's ``environment_factory`` in ``GRPOTrainer``.

Why: TRL 1.16's ``GRPOTrainer._generate_and_score_completions`` draws one environment per rollout from its pool
(``_environment_pool[name]``, handed out in order from index 0 each batch, grown with the factory when a batch needs
more) and then calls each one's ``reset(**row)`` in a loop on the trainer's thread. A reset that starts a sandbox or
loads a repository (seconds) then costs the batch size times that per step, and one that hangs hangs the run. TRL
leaves no hook between the draw and that loop.

The workaround does the draw's work first, with nothing in TRL changed: it grows the pool as TRL would (so TRL then
hands out the very instances prepared here), runs every reset at once, each in a thread of its own under a timeout, and
gives each drawn instance an *instance* attribute ``reset`` (it shadows the class's method for TRL's one call, then
removes itself) that returns the observation already computed. Tool discovery is unaffected: TRL lists an
environment's tools from its class. If TRL calls ``reset`` with other arguments than the ones prepared, the
environment's own ``reset`` runs (TRL's behaviour). Environments without an instance ``__dict__`` (``__slots__``)
keep TRL's serial resets.

With ``run=False`` the drawn instances are not reset at all and TRL's call returns None: for ``AsyncGRPOTrainer``,
whose producer resets environments of its own for every group it samples (TRL's then go unused).

Covered: TRL 1.16 (checked: 1.16.0). ``tests/test_trl_contract.py`` fails when the lines this relies on change.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import trl

TESTED_TRL = ("1.16",)


class EnvironmentResetTimeout(TimeoutError):
    """An environment's ``reset`` did not return within ``tool_timeout``."""


def supported() -> bool:
    """Whether this TRL is one whose environment draw and reset loop this module was checked against."""
    return trl.__version__.startswith(TESTED_TRL)


class _PreparedReset:
    """An instance's ``reset`` for TRL's one call: the prepared observation if called with the prepared row."""

    def __init__(self, environment: Any, observation: Any, kwargs: dict | None):
        self.environment = environment
        self.observation = observation
        self.kwargs = kwargs  # None: any arguments (run=False: TRL's instances are not used)

    def __call__(self, **kwargs: Any) -> Any:
        _unshadow(self.environment)
        if self.kwargs is not None and not _same_arguments(kwargs, self.kwargs):
            return self.environment.reset(**kwargs)  # not the row prepared for: the environment's own reset
        return self.observation


def _same_arguments(given: dict, prepared: dict) -> bool:
    """The same keys with the same objects (rows are passed by TRL as they are: identity, not equality)."""
    return given.keys() == prepared.keys() and all(given[key] is prepared[key] for key in given)


def _unshadow(environment: Any) -> None:
    if isinstance(vars(environment).get("reset"), _PreparedReset):
        del vars(environment)["reset"]


def _reset_arguments(row: dict, multi_environment: bool) -> dict:
    # TRL's rule: in multi-environment mode ``environment`` is a routing field, not a reset argument.
    return {k: v for k, v in row.items() if k != "environment"} if multi_environment else row


def draw_like_trl(trainer: Any, inputs: list[dict]) -> list[Any]:
    """The environment instances TRL's rollout will hand to ``inputs`` (growing its pool as TRL would). A row naming
    an environment that is not among the factories raises TRL's error, before any pool grows, as TRL does."""
    names = [x.get("environment") if trainer._multi_environment else None for x in inputs]
    for name in dict.fromkeys(names):
        if name not in trainer.environment_factories:
            raise ValueError(
                f"Example has `environment={name!r}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(trainer.environment_factories)}."
            )
    drawn, handed = [], Counter()
    for name in names:
        pool = trainer._environment_pool[name]
        if handed[name] == len(pool):
            pool.append(trainer.environment_factories[name]())
        drawn.append(pool[handed[name]])
        handed[name] += 1
    return drawn


class PreparedResets:
    """The drawn instances with the observation and arguments of each (``installed`` shadows their ``reset``)."""

    def __init__(self, environments: list[Any], observations: list[Any], arguments: list[dict | None]):
        self.environments, self.observations, self.arguments = environments, observations, arguments


def prepare_resets(trainer: Any, inputs: list[dict], timeout: float, run: bool = True) -> PreparedResets | None:
    """Draws TRL's instances for ``inputs`` and resets them at once (``run``); None where TRL's serial loop must run
    (no environments drawn, or instances without ``__dict__``)."""
    environments = draw_like_trl(trainer, inputs)
    if not environments or not all(hasattr(env, "__dict__") for env in environments):
        return None
    if not run:
        return PreparedResets(environments, [None] * len(environments), [None] * len(environments))
    arguments = [_reset_arguments(row, trainer._multi_environment) for row in inputs]
    return PreparedResets(environments, run_resets(environments, arguments, timeout), arguments)


@contextlib.contextmanager
def installed(prepared: PreparedResets | None) -> Iterator[None]:
    """Within the block, TRL's call of each drawn instance's ``reset`` returns its prepared observation."""
    if prepared is None:
        yield
        return
    for environment, observation, kwargs in zip(
        prepared.environments, prepared.observations, prepared.arguments, strict=True
    ):
        vars(environment)["reset"] = _PreparedReset(environment, observation, kwargs)
    try:
        yield
    finally:
        for environment in prepared.environments:
            _unshadow(environment)


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
