"""A rollout's prompts with TRL's environments (agents/environment_resets.py, compat/trl_rollout_environments.py):
the instances TRL's pool hands out, reset at once under tool_timeout (or one after another under lockstep), their
observations appended to the prompts as TRL appends them, the tool dicts TRL's driver reads; failures named."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from trlx_scale.agents.environment_resets import rollout_prompts
from trlx_scale.compat.trl_rollout_environments import (
    EnvironmentResetTimeout,
    draw_like_trl,
    run_resets,
    with_observation,
)


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

    def lookup(self, key: str) -> str:
        """A tool: the environment's public method."""
        return key

    async def fetch(self, key: str) -> str:
        return key


class _TrainerLike:
    """The attributes of TRL 1.16's GRPOTrainer that its environment draw and tool dicts read (pinned by
    tests/test_trl_contract.py), with GRPOTrainer's prompt stage."""

    def _rollout_prompts(self, rows: list[dict]) -> list:
        return rollout_prompts(self, rows)

    def _resets_trl_environments(self) -> bool:
        return True

    def __init__(self, factories: dict | None, multi: bool = False, scheduling: str = "concurrent", tools=()):
        self.environment_factories = factories
        self._multi_environment = multi
        self._environment_pool = {name: [] for name in factories or {}}
        self._standalone_tools = list(tools)
        self.tools = list(tools) + (["environment methods"] if factories else [])
        self.environments = None
        self.args = SimpleNamespace(tool_scheduling=scheduling, tool_timeout=10.0)
        self.accelerator = None  # one process


def _rows(count: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"task {i}: "}], "task": i} for i in range(count)]


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


def test_prompts_get_their_observations_and_the_rows_are_left_as_they_were():
    trainer = _TrainerLike({None: _Env})
    rows = _rows(3)
    prompts = trainer._rollout_prompts(rows)
    assert [p[-1]["content"] for p in prompts] == [f"task {i}: observation {i}" for i in range(3)]
    assert [r["prompt"][-1]["content"] for r in rows] == [f"task {i}: " for i in range(3)]
    assert trainer.environments == trainer._environment_pool[None] and trainer._batch_environments == [None] * 3
    # A reset gets the dataset row's columns (TRL's call: reset(**row)).
    assert [env.resets[0] for env in trainer.environments] == rows


def test_tool_dicts_hold_the_standalone_tools_and_each_environments_methods():
    def add(a: int, b: int) -> int:
        return a + b

    trainer = _TrainerLike({None: _Env}, tools=[add])
    trainer._rollout_prompts(_rows(2))
    assert [sorted(d) for d in trainer._sync_tool_dicts] == [["add", "lookup"], ["add", "lookup"]]
    assert [sorted(d) for d in trainer._async_tool_dicts] == [["fetch"], ["fetch"]]
    # Bound to the rollout's own instance.
    assert [d["lookup"].__self__ for d in trainer._sync_tool_dicts] == trainer.environments
    alone = _TrainerLike(None, tools=[add])  # tools without environments: the standalone ones
    assert [p[-1]["content"] for p in alone._rollout_prompts(_rows(2))] == ["task 0: ", "task 1: "]
    assert alone._sync_tool_dicts == [{"add": add}, {"add": add}] and alone._async_tool_dicts == [{}, {}]


def test_multi_environment_resets_leave_the_routing_column_out():
    trainer = _TrainerLike({"a": _Env, "b": _Env}, multi=True)
    rows = [{**row, "environment": name} for row, name in zip(_rows(3), "aba", strict=True)]
    trainer._rollout_prompts(rows)
    assert [sorted(env.resets[0]) for env in trainer.environments] == [["prompt", "task"]] * 3
    assert trainer._batch_environments == ["a", "b", "a"]


def test_observations_join_text_and_content_blocks_as_trls_do():
    text = [{"role": "user", "content": "hi "}]
    assert with_observation(text, "there") == [{"role": "user", "content": "hi there"}]
    assert with_observation(text, [{"type": "text", "text": "x"}]) == [
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "x"}]}
    ]
    blocks = [{"role": "user", "content": [{"type": "text", "text": "a"}]}]
    assert with_observation(blocks, "b")[-1]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
    ]
    assert with_observation(text, None) is text


@pytest.mark.parametrize("scheduling", ["concurrent", "lockstep"])
def test_resets_run_at_once_under_concurrent_scheduling_and_one_after_another_under_lockstep(scheduling):
    threads = []

    class Recording(_Env):
        def reset(self, **row):
            threads.append(threading.current_thread().name)
            return super().reset(**row)

    barrier = threading.Barrier(3, timeout=5) if scheduling == "concurrent" else None  # serial resets never pass it
    trainer = _TrainerLike({None: lambda: Recording(wait=barrier)}, scheduling=scheduling)
    prompts = trainer._rollout_prompts(_rows(3))
    assert [p[-1]["content"] for p in prompts] == [f"task {i}: observation {i}" for i in range(3)]
    assert len(threads) == 3
    assert ("MainThread" not in threads) == (scheduling == "concurrent")


def test_asynchronous_runs_draw_without_resetting():
    class Drawing(_TrainerLike):
        def _resets_trl_environments(self) -> bool:
            return False

    trainer = Drawing({None: _Env})
    prompts = trainer._rollout_prompts(_rows(2))
    assert [p[-1]["content"] for p in prompts] == ["task 0: ", "task 1: "]
    assert len(trainer.environments) == 2 and [env.resets for env in trainer.environments] == [[], []]


def test_a_failed_reset_is_raised_from_the_rollout():
    trainer = _TrainerLike({None: lambda: _Env(fail=True)}, scheduling="lockstep")
    with pytest.raises(ValueError, match="no task 0"):
        trainer._rollout_prompts(_rows(2))


def test_a_hung_reset_is_named_within_its_timeout():
    released = threading.Event()
    trainer = _TrainerLike({None: lambda: _Env(hang=released)})
    try:
        with pytest.raises(
            EnvironmentResetTimeout, match=r"2 of 2 _Env.reset calls did not return within tool_timeout"
        ):
            run_resets(draw_like_trl(trainer, [{}, {}]), [{"task": 0}, {"task": 1}], timeout=0.5)
    finally:
        released.set()


def test_a_reset_that_raises_raises_its_own_error_at_once():
    trainer = _TrainerLike({None: lambda: _Env(fail=True)})
    started = time.monotonic()
    with pytest.raises(ValueError, match="no task 0"):
        run_resets(draw_like_trl(trainer, [{}, {}]), [{"task": 0}, {"task": 1}], timeout=30)
    assert time.monotonic() - started < 5
