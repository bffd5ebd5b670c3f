"""What a rollout's call of TRL's generation driver carries besides prompts: the dataset rows, the served groups.

Why: TRL 1.16's ``_generate(prompts)`` is the rollout's generation driver (chat template, response parsing, the tool
loop, a ``rollout_func``'s contract), and its signatures carry token ids and text only. Two values of a trlx_scale
rollout must cross it:

- the dataset **rows** of the prompts, which a ``GymRollout``'s environments reset from: TRL hands a
  ``rollout_func`` the prompts alone;
- the producer's **scored groups** the server engine's completions are (``AsyncGRPOTrainer``: their rewards, policy
  versions and tool trajectories were computed off the training loop): TRL returns the completion ids alone.

The trainer's sampling stage binds a ``GenerationCall`` (the rows) around its ``_generate`` call; the server engine
records in it each group it hands out (``take_groups``), and ``GymRollout`` reads the rows from it. It is a
``ContextVar``: nothing outlives the call or reaches another thread, which holds because TRL's driver calls
``rollout_func`` and ``_generate_single_turn`` on the caller's thread. ``tests/test_trl_contract.py`` fails when that
stops being true.

Covered: TRL 1.16 (checked: 1.16.0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

TESTED_TRL = ("1.16",)


@dataclass
class GenerationCall:
    """One call of TRL's ``_generate``: the dataset rows of its prompts, and the server engine's groups it got."""

    rows: list[dict[str, Any]]
    groups: list = field(default_factory=list)


_CALL: ContextVar[GenerationCall | None] = ContextVar("trlx_scale_generation_call", default=None)


@contextlib.contextmanager
def generation_call(rows: list[dict[str, Any]]) -> Iterator[GenerationCall]:
    """Bind the rows of the prompts TRL's ``_generate`` is called with inside this block."""
    call = GenerationCall(rows)
    token = _CALL.set(call)
    try:
        yield call
    finally:
        _CALL.reset(token)


def current_generation_call() -> GenerationCall | None:
    """The generation call in progress (None outside one: a rollout built outside the collector)."""
    return _CALL.get()


def record_served_groups(groups: list) -> None:
    """The server engine's groups, handed out inside the current generation call (none outside one)."""
    call = _CALL.get()
    if call is not None:
        call.groups.extend(groups)


def served_groups(groups: list | None, what: str) -> list:
    """The groups a generation call got from the server engine; ``what``: the step that should have taken them."""
    if not groups:
        raise RuntimeError(
            f"{what}: no server engine groups were recorded in this generation call: TRL's generation driver no "
            "longer runs the engine on the caller's thread inside the sampling stage (compat.trl_generation_call; "
            "see tests/test_trl_contract.py). The installed TRL is not the version this trlx_scale supports."
        )
    return groups
