"""``--reward_funcs``: reward functions named on the command line, as TRL's ``trl grpo`` names them.

A name is one of TRL's built-in rewards (``accuracy_reward``, ``reasoning_accuracy_reward``, ``think_format_reward``,
``get_soft_overlong_punishment`` with TRL's script values), trlx_scale's ``exact_match`` (the completion equals the
answer column), or a dotted import path (``my_lib.rewards.custom_reward``, importable from the working directory).
With no name the examples score exact match against ``--answer_column``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from .addition import exact_match_reward

EXACT_MATCH = "exact_match"


def _trl_rewards() -> dict[str, Callable]:
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    # The values TRL's own grpo script uses for the overlong punishment.
    return {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
    }


def exact_match_on(answer_column: str) -> Callable:
    """Exact match of the completion against the dataset column ``answer_column``."""

    def reward_exact_match(completions, **columns):
        if answer_column not in columns:
            raise ValueError(
                f"exact_match scores against the '{answer_column}' column, which the dataset lacks (columns: "
                f"{sorted(columns)}); set --answer_column."
            )
        return exact_match_reward(completions, answer=columns[answer_column])

    return reward_exact_match


def resolve_reward_functions(names: list[str] | None, answer_column: str) -> list[Callable]:
    """The reward functions ``names`` give (see the module docstring); exact match when there are none."""
    if not names:
        return [exact_match_on(answer_column)]
    trl_rewards = _trl_rewards()
    functions = []
    for name in names:
        if name == EXACT_MATCH:
            functions.append(exact_match_on(answer_column))
        elif name in trl_rewards:
            functions.append(trl_rewards[name])
        elif "." in name:
            module_path, attribute = name.rsplit(".", 1)
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # a user's own module beside the command, as TRL's script allows
            try:
                functions.append(getattr(importlib.import_module(module_path), attribute))
            except (ImportError, AttributeError) as error:
                raise ValueError(f"--reward_funcs {name}: cannot import it ({error}).") from error
        else:
            raise ValueError(
                f"--reward_funcs {name!r} is not a known reward: use one of {[EXACT_MATCH, *trl_rewards]} or a dotted "
                "import path (my_module.my_reward)."
            )
    return functions
