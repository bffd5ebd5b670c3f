"""TRL environments reset off the trainer's thread (compat/trl_environment_resets.py): the instances TRL's rollout
will draw, reset at once under tool_timeout, their observations handed to TRL's own call; failures named."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from trlx_scale.compat.trl_environment_resets import (
    EnvironmentResetTimeout,
    draw_like_trl,
    installed,
    prepare_resets,
)
from trlx_scale.trainer.environment_reset_mixin import EnvironmentResetMixin


class _Env:
    made = 0

    def __init__(self, wait: threading.Barrier | None = None, hang: threading.Event | None = None, fail: bool = False):
        _Env.made += 1
        self.wait, self.hang, self.fail = wait, hang, fail
        self.resets: list[dict] = []

    def reset(self, **row):
        self.resets.append(row)
        if self.wait is not None:
            self.wait.wait()
        if self.fail:
            raise ValueError(f"no task {row['task']}")
        if self.hang is not None:
            self.hang.wait(
                30
            )  # hung until the test lets it go (an abandoned thread would hold the interpreter's exit)
        return f"observation {row['task']}"


class _TrainerLike:
    """The attributes of TRL 1.16's GRPOTrainer that its draw reads (pinned by tests/test_trl_contract.py)."""

    def __init__(self, factories: dict, multi: bool = False):
        self.environment_factories = factories
        self._multi_environment = multi
        self._environment_pool = {name: [] for name in factories}


def test_the_draw_hands_out_what_trls_pool_would_and_grows_it_once():
    trainer = _TrainerLike({"a": _Env, "b": _Env}, multi=True)
    rows = [{"environment": name, "task": i} for i, name in enumerate("abab")]
    first = draw_like_trl(trainer, rows)
    assert [len(pool) for pool in trainer._environment_pool.values()] == [2, 2]
    assert first == [trainer._environment_pool[n][k] for n, k in (("a", 0), ("b", 0), ("a", 1), ("b", 1))]
    assert draw_like_trl(trainer, rows[:2]) == first[:2]  # each batch starts from index 0, as TRL's cursor does
    # TRL's error for an unknown environment, raised before any pool grows (so every rank hears of it at once).
    with pytest.raises(ValueError, match=r"`environment='c'`, which is not among the environments passed to"):
        draw_like_trl(trainer, [{"environment": "a"}] * 3 + [{"environment": "c"}])
    assert [len(pool) for pool in trainer._environment_pool.values()] == [2, 2]


def test_multi_environment_resets_leave_the_routing_column_out_and_trls_call_matches_them():
    trainer = _TrainerLike({"a": _Env, "b": _Env}, multi=True)
    rows = [{"environment": name, "task": i} for i, name in enumerate("aba")]
    prepared = prepare_resets(trainer, rows, timeout=10)
    assert [env.resets for env in prepared.environments] == [[{"task": 0}], [{"task": 1}], [{"task": 2}]]
    with installed(prepared):
        for env, row in zip(prepared.environments, rows, strict=True):
            # TRL's multi-environment call: a new dict without the routing column, the same values.
            assert env.reset(**{k: v for k, v in row.items() if k != "environment"}) == f"observation {row['task']}"
    assert all(len(env.resets) == 1 for env in prepared.environments)


def test_the_shadows_are_removed_when_the_rollout_raises():
    trainer = _TrainerLike({None: _Env})
    prepared = prepare_resets(trainer, [{"task": 0}, {"task": 1}], timeout=10)
    with pytest.raises(RuntimeError, match="the engine died"), installed(prepared):
        assert all("reset" in vars(env) for env in prepared.environments)
        raise RuntimeError("the engine died")
    assert all("reset" not in vars(env) for env in prepared.environments)


def test_resets_run_at_once_and_trls_call_reads_their_observations():
    barrier = threading.Barrier(4, timeout=5)  # one reset after another would never pass it
    trainer = _TrainerLike({None: lambda: _Env(wait=barrier)})
    rows = [{"task": i} for i in range(4)]
    prepared = prepare_resets(trainer, rows, timeout=10)
    environments = trainer._environment_pool[None]
    assert [len(env.resets) for env in environments] == [1, 1, 1, 1]
    with installed(prepared):
        # TRL's loop: environment.reset(**row), with the row itself.
        assert [env.reset(**row) for env, row in zip(environments, rows, strict=True)] == [
            f"observation {i}" for i in range(4)
        ]
        assert [len(env.resets) for env in environments] == [1, 1, 1, 1]  # not reset twice
    assert all("reset" not in vars(env) for env in environments)  # the class's own method again
    barrier.reset()
    with installed(prepare_resets(trainer, rows, timeout=10)):
        other = {"task": 9}
        environments[0].wait = None
        assert environments[0].reset(**other) == "observation 9"  # not the prepared row: the environment's reset
    assert [len(env.resets) for env in environments] == [3, 2, 2, 2]


def test_asynchronous_runs_draw_without_resetting():
    trainer = _TrainerLike({None: _Env})
    prepared = prepare_resets(trainer, [{"task": 0}, {"task": 1}], timeout=10, run=False)
    environments = trainer._environment_pool[None]
    with installed(prepared):
        assert [env.reset(task=k) for k, env in enumerate(environments)] == [None, None]
    assert [env.resets for env in environments] == [[], []]


def test_a_hung_reset_is_named_within_its_timeout():
    released = threading.Event()
    trainer = _TrainerLike({None: lambda: _Env(hang=released)})
    started = time.monotonic()
    try:
        with pytest.raises(
            EnvironmentResetTimeout, match=r"2 of 2 _Env.reset calls did not return within tool_timeout"
        ):
            prepare_resets(trainer, [{"task": 0}, {"task": 1}], timeout=0.5)
        assert time.monotonic() - started < 5
    finally:
        released.set()


def test_a_reset_that_raises_raises_its_own_error_at_once():
    trainer = _TrainerLike({None: lambda: _Env(fail=True)})
    started = time.monotonic()
    with pytest.raises(ValueError, match="no task 0"):
        prepare_resets(trainer, [{"task": 0}, {"task": 1}], timeout=30)
    assert time.monotonic() - started < 5


def test_environments_without_an_instance_dict_keep_trls_serial_resets():
    class Slotted:
        __slots__ = ()

        def reset(self, **row):
            raise AssertionError("not reset here")

    assert prepare_resets(_TrainerLike({None: Slotted}), [{"task": 0}], timeout=1) is None


class _TRLLikeRollout:
    """TRL 1.16's draw and serial reset loop, as its ``_generate_and_score_completions`` runs them (the lines the
    contract test pins), under the mixin."""

    def __init__(self, factories: dict, scheduling: str):
        self.environment_factories, self._multi_environment = factories, False
        self._environment_pool = {name: [] for name in factories}
        self.args = SimpleNamespace(tool_scheduling=scheduling, tool_timeout=10.0)
        self.accelerator = None  # one process
        self.model = SimpleNamespace(training=True)

    def _generate_and_score_completions(self, inputs):
        self.environments = draw_like_trl(self, inputs)
        return [environment.reset(**x) for environment, x in zip(self.environments, inputs, strict=True)]


class _Trainer(EnvironmentResetMixin, _TRLLikeRollout):
    pass


@pytest.mark.parametrize("scheduling", ["concurrent", "lockstep"])
def test_the_mixin_resets_at_once_under_concurrent_scheduling_and_leaves_lockstep_to_trl(scheduling):
    threads = []

    class Recording(_Env):
        def reset(self, **row):
            threads.append(threading.current_thread().name)
            return super().reset(**row)

    barrier = threading.Barrier(3, timeout=5) if scheduling == "concurrent" else None
    trainer = _Trainer({None: lambda: Recording(wait=barrier)}, scheduling)
    rows = [{"task": i} for i in range(3)]
    assert trainer._generate_and_score_completions(rows) == [f"observation {i}" for i in range(3)]
    assert len(threads) == 3
    assert ("MainThread" not in threads) == (scheduling == "concurrent")
