"""Synchronous reward functions in worker processes (trlx_scale/rollout/reward_processes.py): the rewards and TRL's
log calls come back, errors reach the guard in the trainer's process, and what a worker cannot import is refused by
name. The asynchronous trainer's run with them is in tests/test_async_grpo.py."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from trlx_scale.reliability.reward_guard import (
    GuardedRewardFunction,
    RewardScoringUnavailable,
    guard_reward_functions,
)
from trlx_scale.rollout.reward_processes import (
    ProcessRewardFunction,
    RewardProcessPool,
    check_sendable,
    send_reward_functions_to_processes,
)

from .helpers.process_rewards import (
    dying_reward,
    failing_on_x_reward,
    logging_then_failing_reward,
    slow_reward,
    worker_pid_reward,
)

FIELD = "async_reward_processes"


@pytest.fixture(scope="module")
def pool():
    pool = RewardProcessPool(1)
    yield pool
    pool.close()


def test_a_reward_runs_in_a_worker_and_its_log_calls_are_replayed_here(pool):
    metrics, extras = [], []
    scored = ProcessRewardFunction(worker_pid_reward, pool)
    assert scored.__name__ == "worker_pid_reward"  # TRL's metric names
    rewards = scored(
        prompts=["p", "p"],
        completions=["ab", "abcd"],
        log_metric=lambda name, value: metrics.append((name, value)),
        log_extra=lambda column, values: extras.append((column, values)),
    )
    assert rewards == [2.0, 4.0]
    assert len(metrics) == 1 and metrics[0][0] == "worker_pid"
    assert metrics[0][1] != float(os.getpid())  # it ran in another process
    assert extras == [("worker_note", ["scored 2", "scored 2"])]


@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_a_worker_s_exception_reaches_the_guard_which_locates_the_sample(pool, mode):
    guard = GuardedRewardFunction(ProcessRewardFunction(failing_on_x_reward, pool), mode)
    rewards = guard(prompts=["p"] * 3, completions=["a", "x", "b"])
    assert rewards[0] == 1.0 and rewards[2] == 1.0 and rewards[1] is None  # scored one by one, in the worker
    errors, skipped = guard.pop_report()
    if mode == "skip":
        assert (errors, skipped) == ([], 1)
    else:
        assert len(errors) == 1 and "raised ValueError: cannot score 'x' on sample 1" in errors[0]


def _worker_pid(scored) -> float:
    metrics = []
    scored(prompts=["p"], completions=["a"], log_metric=lambda *call: metrics.append(call), log_extra=lambda *_: None)
    return metrics[0][1]


def test_a_closed_pool_refuses_calls_until_opened_again_with_new_workers():
    pool = RewardProcessPool(1)
    scored = ProcessRewardFunction(worker_pid_reward, pool)
    first = _worker_pid(scored)
    pool.close()
    assert pool._pool is None
    with pytest.raises(RewardScoringUnavailable, match="were stopped \\(the run ended\\) before this reward"):
        _worker_pid(scored)  # a call after the run's end starts no new workers
    assert pool._pool is None
    pool.open()
    assert _worker_pid(scored) != first  # a new worker
    pool.close()


def test_closing_under_a_call_stops_its_worker_and_the_call_says_so():
    pool = RewardProcessPool(1)
    guard = GuardedRewardFunction(ProcessRewardFunction(slow_reward, pool), "skip")
    outcome = []

    def call():
        try:
            guard(prompts=["p"], completions=["a"])
        except RewardScoringUnavailable as error:
            outcome.append(str(error))

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(3)  # the worker started (spawn) and sleeps in the reward
    pool.close()
    caller.join(timeout=20)
    assert not caller.is_alive()  # released by the close, not by the reward's 30 s
    assert len(outcome) == 1 and "stopped (the run ended) under this call" in outcome[0]
    assert guard.pop_report() == ([], 0)  # not blamed on a sample
    assert pool._pool is None


def test_a_dead_worker_stops_the_run_by_name_and_the_next_call_gets_a_new_one(pool):
    guard = GuardedRewardFunction(ProcessRewardFunction(dying_reward, pool), "skip")
    with pytest.raises(RewardScoringUnavailable, match="reward function 'dying_reward': its worker process stopped"):
        guard(prompts=["p", "p"], completions=["a", "b"])
    assert guard.pop_report() == ([], 0)  # raised as it is: no sample retried or skipped
    assert ProcessRewardFunction(failing_on_x_reward, pool)(prompts=["p"], completions=["a"]) == [1.0]


def test_log_calls_made_before_an_exception_are_replayed_and_the_exception_comes_back(pool):
    metrics = []
    scored = ProcessRewardFunction(logging_then_failing_reward, pool)
    with pytest.raises(RuntimeError, match="_TwoArgumentError: no score at sample 0"):
        scored(prompts=["p"], completions=["a"], log_metric=lambda *call: metrics.append(call))
    assert metrics == [("before_failing", 1.0)]
    assert ProcessRewardFunction(failing_on_x_reward, pool)(prompts=["p"], completions=["a"]) == [1.0]  # pool intact


def _closure_reward():
    scale = 2.0

    def scaled(completions, **kwargs):
        return [scale] * len(completions)

    return scaled


def test_what_a_worker_cannot_import_is_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match=r"async_reward_processes: the reward function '<lambda>' cannot be sent"):
        check_sendable(lambda completions, **kwargs: [0.0] * len(completions), FIELD)
    with pytest.raises(ValueError, match=r"'scaled' cannot be sent to a worker process .*not a lambda or a closure"):
        check_sendable(_closure_reward(), FIELD)

    def script_reward(completions, **kwargs):
        return [0.0] * len(completions)

    # As if defined in the training script: it pickles (by reference to __main__), but a worker cannot import it.
    script_reward.__module__, script_reward.__qualname__ = "__main__", "script_reward"
    monkeypatch.setattr(sys.modules["__main__"], "script_reward", script_reward, raising=False)
    with pytest.raises(ValueError, match=r"'script_reward' is defined in the training script \(__main__\)"):
        check_sendable(script_reward, FIELD)
    check_sendable(worker_pid_reward, FIELD)  # a module's top-level function goes


def test_guarded_functions_are_sent_async_ones_stay_and_environments_are_refused():
    async def remote(completions, **kwargs):
        return [0.0] * len(completions)

    funcs = guard_reward_functions([worker_pid_reward, remote], "raise")
    assert send_reward_functions_to_processes(funcs, 0, None, None, FIELD) is None  # 0: threads, nothing changed
    assert funcs[0].func is worker_pid_reward
    pool = send_reward_functions_to_processes(funcs, 2, None, None, FIELD)
    try:
        assert isinstance(funcs[0], GuardedRewardFunction)  # the guard stays in the trainer's process
        assert isinstance(funcs[0].func, ProcessRewardFunction) and funcs[0].func.pool is pool
        assert funcs[1] is remote  # awaited on the producer's loop, as before
        rewards = funcs[0](prompts=["p"], completions=["abc"], log_metric=lambda *a: None, log_extra=lambda *a: None)
        assert rewards == [3.0]
    finally:
        pool.close()
    guarded = guard_reward_functions([worker_pid_reward], "raise")
    with pytest.raises(ValueError, match="async_reward_processes=1 with environment_factory: rewards that read"):
        send_reward_functions_to_processes(guarded, 1, object, None, FIELD)
    with pytest.raises(ValueError, match="async_reward_processes=1 with rollout_func \\(a GymRollout\\)"):
        send_reward_functions_to_processes(guarded, 1, None, object(), FIELD)
