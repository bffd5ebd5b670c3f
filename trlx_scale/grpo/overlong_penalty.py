"""DAPO's soft overlong punishment (Eq. 13 of the DAPO paper) as a reward column of ``GRPOTrainer`` (and of its
subclasses, PPO and the asynchronous trainer): a completion within the last ``overlong_buffer_length`` tokens before
``max_completion_length`` loses reward linearly, down to ``-overlong_penalty_factor`` at the limit.

Beside TRL's ``mask_truncated_completions`` (which takes a completion cut at the limit out of the loss), this shapes
the completions that fit: the model learns to finish before the limit. The length is the completion's token count as
TRL counts it against ``max_completion_length``: in a multi-turn trajectory the sampled and the tool tokens after the
prompt, the budget TRL's tool loop and trlx_scale's enforce. It is a reward column of its own (``overlong_penalty``
in the logs, weight 1), so packed and padded passes, and every rollout path, see it as any reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..trl_config_upgrade import registers_options


@registers_options()
@dataclass
class OverlongPenaltyFields:
    """DAPO's soft overlong punishment (``grpo.overlong_penalty``)."""

    overlong_buffer_length: int | None = field(
        default=None,
        metadata={
            "help": "DAPO's soft overlong punishment: a reward column 'overlong_penalty' (weight 1, appended to "
            "reward_weights when those are given) that is 0 up to max_completion_length - overlong_buffer_length "
            "tokens, falls linearly to -overlong_penalty_factor at max_completion_length, and is "
            "-overlong_penalty_factor beyond (DAPO: buffer 4096 of 20480 tokens). The length is TRL's completion "
            "length (in multi-turn trajectories the sampled and tool tokens after the prompt). Unset: off."
        },
    )
    overlong_penalty_factor: float = field(
        default=1.0,
        metadata={"help": "With overlong_buffer_length: the penalty at and beyond max_completion_length (DAPO: 1.0)."},
    )

    def validate_overlong_penalty_fields(self) -> None:
        if self.overlong_buffer_length is None:
            return
        if not 0 < self.overlong_buffer_length <= self.max_completion_length:
            raise ValueError(
                f"overlong_buffer_length must be between 1 and max_completion_length ({self.max_completion_length}) "
                f"tokens, got {self.overlong_buffer_length}: the penalty ramps over the last tokens before the limit."
            )
        if not (self.overlong_penalty_factor > 0 and math.isfinite(self.overlong_penalty_factor)):
            raise ValueError(
                f"overlong_penalty_factor must be a positive finite reward, got {self.overlong_penalty_factor}."
            )


class OverlongPenalty:
    """The reward function (picklable: the asynchronous trainer may score in worker processes)."""

    __name__ = "overlong_penalty"

    def __init__(self, max_completion_length: int, buffer_length: int, factor: float = 1.0):
        self.max_completion_length, self.buffer_length, self.factor = max_completion_length, buffer_length, factor

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        start = self.max_completion_length - self.buffer_length
        penalties = []
        for ids in completion_ids:
            length = len(ids)
            if length <= start:
                penalties.append(0.0)
            elif length <= self.max_completion_length:
                penalties.append(self.factor * (start - length) / self.buffer_length)
            else:
                penalties.append(-self.factor)
        return penalties


def with_overlong_penalty(reward_funcs: Any, reward_processing_classes: Any, args: Any) -> tuple[Any, Any, dict]:
    """``reward_funcs`` (and ``reward_processing_classes``, when a list) with the penalty column appended where
    ``args.overlong_buffer_length`` is set; the third value: the config fields TRL's ``__init__`` must see changed
    (``reward_weights`` with the column's weight 1 appended)."""
    if args.overlong_buffer_length is None:
        return reward_funcs, reward_processing_classes, {}
    user = (
        []
        if reward_funcs is None
        else list(reward_funcs)
        if isinstance(reward_funcs, (list, tuple))
        else [reward_funcs]
    )
    penalty = OverlongPenalty(args.max_completion_length, args.overlong_buffer_length, args.overlong_penalty_factor)
    if isinstance(reward_processing_classes, (list, tuple)):
        reward_processing_classes = [*reward_processing_classes, None]
    switched = {} if args.reward_weights is None else {"reward_weights": [*args.reward_weights, 1.0]}
    return [*user, penalty], reward_processing_classes, switched
