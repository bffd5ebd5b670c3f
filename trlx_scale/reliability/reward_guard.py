"""Reward functions that fail loudly and the same way on every rank.

A plain reward function that raises on rank 1 kills rank 1 with its own bare message while rank 0 waits forever in
the next gather. ``GuardedRewardFunction`` wraps each synchronous reward function: a failing batch is retried sample
by sample to find which sample fails, the failure is recorded (not raised), and the batch gets NaN for that sample
so the trainer reaches its collectives. ``raise_reward_errors`` then runs on every rank at the same point: one MAX
all-reduce of a flag, and only when some rank failed, a gather of the messages, so every rank raises the same
``RewardFunctionError`` naming the function, the rank, the sample index and its (truncated) completion.

A batch call that raises and is then scored sample by sample costs one more call per sample (a paid judge is
called N+1 times): each such retry is counted (``reliability/reward_retries``, summed over ranks) and the first one of
each function is logged with the batch's error, so a transient verifier failure is seen even when every sample then
scores.

With ``reward_errors="skip"`` a failing sample keeps NaN, which TRL treats as a None reward (the other functions'
rewards for that sample still count) and is counted in ``reliability/reward_errors``. A reward of +-inf is always an
error: it would dominate the group's normalisation and silently train on garbage.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from trl.trainer.utils import get_callable_name, is_async_callable

COMPLETION_PREVIEW_CHARS = 200

logger = logging.getLogger(__name__)


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned inf, for a sample."""


class RewardScoringUnavailable(RuntimeError):
    """What runs the reward function failed, not the function on a sample (a worker process died, or was stopped
    under the call): the guard raises it as it is, without retrying the samples one by one or blaming one."""


def _preview(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= COMPLETION_PREVIEW_CHARS else text[:COMPLETION_PREVIEW_CHARS] + "..."


class GuardedRewardFunction:
    """A synchronous reward function (TRL's signature) whose failures are located, recorded and reported.

    Args:
        func: the reward function, ``func(prompts=..., completions=..., **kwargs) -> list[float | None]``.
        mode: ``"raise"`` or ``"skip"`` (see ``ReliabilityFields.reward_errors``).
    """

    def __init__(self, func: Callable, mode: str):
        self.func = func
        self.mode = mode
        functools.update_wrapper(self, func)
        self.__name__ = get_callable_name(func)  # TRL names the reward's metrics after it (partials, instances too)
        self.errors: list[str] = []  # messages of this rank since the last check (raise mode, or inf)
        self.skipped = 0  # samples scored NaN in skip mode since the last check
        self.retries = 0  # batch calls that raised and were scored again sample by sample, since the last check
        self._warned_retry = False
        # The asynchronous producer scores several groups at once in a thread pool: reports are taken atomically.
        self._report_lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.__name__

    def __call__(self, prompts: Sequence, completions: Sequence, **kwargs: Any) -> list:
        try:
            rewards = list(self.func(prompts=prompts, completions=completions, **kwargs))
        except RewardScoringUnavailable:
            raise
        except Exception as batch_error:  # noqa: BLE001 - located per sample below, then reported on every rank
            self._note_retry(batch_error, len(prompts))
            rewards = self._score_one_by_one(prompts, completions, kwargs)
        for index, reward in enumerate(rewards):
            if reward is not None and isinstance(reward, (int, float)) and math.isinf(reward):
                self._record_error(
                    f"reward function '{self.name}' returned {reward} for sample {index} (completion "
                    f"{_preview(completions[index])!r}); rewards must be finite (return None to skip a sample)."
                )
                rewards[index] = None
        return rewards

    def _score_one_by_one(self, prompts: Sequence, completions: Sequence, kwargs: dict) -> list:
        count = len(prompts)
        rewards: list = []
        for index in range(count):
            # List-valued kwargs (dataset columns, completion_ids) are per sample; the rest (trainer_state,
            # log_metric, ...) is passed as is.
            sample_kwargs = {
                key: value[index : index + 1] if isinstance(value, list) and len(value) == count else value
                for key, value in kwargs.items()
            }
            try:
                rewards.extend(
                    self.func(
                        prompts=prompts[index : index + 1], completions=completions[index : index + 1], **sample_kwargs
                    )
                )
            except RewardScoringUnavailable:
                raise
            except Exception as error:  # noqa: BLE001
                rewards.append(None)
                if self.mode == "skip":
                    with self._report_lock:
                        self.skipped += 1
                else:
                    self._record_error(
                        f"reward function '{self.name}' raised {type(error).__name__}: {error} on sample {index} "
                        f"of this rank's batch (prompt {_preview(prompts[index])!r}, completion "
                        f"{_preview(completions[index])!r}). Fix the function, or set reward_errors='skip' to score "
                        "failing samples NaN and go on."
                    )
        return rewards

    def _note_retry(self, error: Exception, count: int) -> None:
        with self._report_lock:
            self.retries += 1
            first, self._warned_retry = not self._warned_retry, True
        if first:
            logger.warning(
                "reward function '%s' raised %s: %s on a batch of %d; scoring it again sample by sample (%d more "
                "calls). Each such retry is counted in reliability/reward_retries; this warning is not repeated.",
                self.name,
                type(error).__name__,
                error,
                count,
                count,
            )

    def _record_error(self, message: str) -> None:
        with self._report_lock:
            self.errors.append(message)

    def pop_report(self) -> tuple[list[str], int]:
        with self._report_lock:
            errors, skipped = self.errors, self.skipped
            self.errors, self.skipped = [], 0
        return errors, skipped

    def pop_retries(self) -> int:
        with self._report_lock:
            retries, self.retries = self.retries, 0
        return retries


class RewardReport(NamedTuple):
    """What the guarded functions recorded since the last check."""

    skipped: int  # samples scored NaN on this rank (skip mode)
    retries: int  # batch calls retried sample by sample, summed over every rank


def guard_reward_functions(reward_funcs: Any, mode: str) -> Any:
    """Wrap each synchronous callable of ``reward_funcs`` (a callable, a list, or None); reward models (modules, model
    ids) and async functions are returned as they are."""
    if reward_funcs is None:
        return None
    single = not isinstance(reward_funcs, (list, tuple))
    funcs = [reward_funcs] if single else list(reward_funcs)
    wrapped = [
        GuardedRewardFunction(f, mode)
        if callable(f)
        and not isinstance(f, (torch.nn.Module, GuardedRewardFunction))
        and not is_async_callable(f)  # TRL awaits those itself (left unguarded)
        else f
        for f in funcs
    ]
    return wrapped[0] if single else wrapped


def raise_reward_errors(reward_funcs: Sequence, accelerator) -> RewardReport:
    """Collect the guarded functions' reports on every rank; raise the same error everywhere if any rank failed.

    Returns what was skipped on this rank and retried on every rank. Call it at the same point on every rank.
    """
    errors: list[str] = []
    skipped = retries = 0
    for func in reward_funcs:
        if isinstance(func, GuardedRewardFunction):
            func_errors, func_skipped = func.pop_report()
            errors.extend(func_errors)
            skipped += func_skipped
            retries += func.pop_retries()
    # One collective for both: the count of failing ranks and the retries, summed.
    counts = torch.tensor([float(bool(errors)), float(retries)], device=accelerator.device)
    if accelerator.num_processes > 1:
        counts = accelerator.reduce(counts, reduction="sum")
    failed_ranks, retries = counts.tolist()
    if failed_ranks > 0:
        from accelerate.utils import gather_object

        rank_errors = (
            gather_object([(accelerator.process_index, errors)])
            if accelerator.num_processes > 1
            else [(accelerator.process_index, errors)]
        )
        lines = [f"rank {rank}: {message}" for rank, messages in rank_errors for message in messages]
        raise RewardFunctionError(f"{len(lines)} reward error(s):\n" + "\n".join(lines[:10]))
    return RewardReport(skipped, int(retries))
