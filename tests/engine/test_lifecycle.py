"""The sleep/wake lifecycle against a fake engine: documented order, refused out-of-order calls, no-sleep platforms."""

import pytest

from trlx_scale.generation.lifecycle import EngineLifecycle, EngineState, LifecycleError


class FakeEngine:
    def __init__(self):
        self.calls = []

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def _round(lifecycle):
    lifecycle.wake_weights()
    lifecycle.wake_kv_cache()
    lifecycle.begin_generation()
    lifecycle.end_generation(sleep=True)


def test_lifecycle_runs_the_documented_order():
    engine = FakeEngine()
    lifecycle = EngineLifecycle(engine, sleep_level=1, enabled=True, start_asleep=True)
    _round(lifecycle)
    assert engine.calls == [
        ("wake_up", ("weights",)),
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),
        ("sleep", 1),
    ]
    assert lifecycle.state is EngineState.ASLEEP and not lifecycle.weights_discarded
    assert set(lifecycle.timings) == {"wake_weights", "wake_kv_cache", "sleep"}


def test_lifecycle_rejects_out_of_order_calls():
    lifecycle = EngineLifecycle(FakeEngine(), sleep_level=2, enabled=True, start_asleep=True)
    assert lifecycle.weights_discarded
    with pytest.raises(LifecycleError, match="cannot wake the KV cache while the engine is asleep"):
        lifecycle.wake_kv_cache()
    with pytest.raises(LifecycleError, match="cannot generate while the engine is asleep"):
        lifecycle.begin_generation()
    with pytest.raises(ValueError, match="sleep_level must be one of"):
        EngineLifecycle(FakeEngine(), sleep_level=3, enabled=True)


def test_lifecycle_without_sleep_mode_skips_vllm_calls_but_not_the_order():
    """CPU: same transitions, no sleep/wake calls; the prefix cache is still reset after every sync."""
    engine = FakeEngine()
    lifecycle = EngineLifecycle(engine, sleep_level=2, enabled=False, start_asleep=True)
    _round(lifecycle)
    assert engine.calls == [("reset_prefix_cache",)]
    assert lifecycle.transitions == ["wake_weights", "wake_kv_cache", "reset_prefix_cache", "sleep"]


def test_lifecycle_of_an_engine_that_never_sleeps():
    engine = FakeEngine()
    lifecycle = EngineLifecycle(engine, sleep_level=1, enabled=False, start_asleep=False)
    lifecycle.wake_weights()  # no-op: awake
    lifecycle.wake_kv_cache()
    lifecycle.begin_generation()
    lifecycle.end_generation(sleep=False)
    assert lifecycle.state is EngineState.AWAKE and engine.calls == [("reset_prefix_cache",)]
