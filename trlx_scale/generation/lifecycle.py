"""The colocated engine's sleep/wake lifecycle as an explicit state machine.

Between rollouts vLLM sleeps so that training gets the device memory back; each rollout then follows one order:

    ASLEEP --wake_weights--> WEIGHTS_AWAKE --(weight sync)--> --wake_kv_cache--> AWAKE
           --begin_generation (prefix cache reset)--> GENERATING --end_generation--> ASLEEP (sleep)

Sleep level 1 offloads the weights to host RAM and keeps them: right when only LoRA adapters change (the base is
never re-sent). Level 2 discards them: right for full fine-tuning, where every weight is re-pushed after waking
anyway (never through vLLM's reload from disk, which would serve the checkpoint's weights: TRL issue 5312).

On platforms without sleep mode (CPU) the same transitions run, with the vLLM calls skipped and a warning logged
once, so the orchestration is exercised everywhere.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from typing import Protocol

from .engine_options import check_resolved_sleep_level

logger = logging.getLogger(__name__)


class EngineState(enum.Enum):
    ASLEEP = "asleep"
    WEIGHTS_AWAKE = "weights_awake"
    AWAKE = "awake"
    GENERATING = "generating"


class SleepableEngine(Protocol):
    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> object: ...

    def reset_prefix_cache(self) -> object: ...


class LifecycleError(RuntimeError):
    pass


class EngineLifecycle:
    """Drives ``llm.sleep``/``llm.wake_up`` in the only valid order and times each transition.

    Args:
        llm: the vLLM engine (or anything with ``sleep``, ``wake_up``, ``reset_prefix_cache``).
        sleep_level: 1 (keep weights in host RAM) or 2 (discard them).
        enabled: whether sleep/wake calls reach vLLM; False where the platform has no sleep mode.
        start_asleep: the engine was put to sleep right after creation.
        clock: for tests.
    """

    def __init__(
        self,
        llm: SleepableEngine,
        sleep_level: int,
        enabled: bool,
        start_asleep: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.llm = llm
        self.sleep_level = check_resolved_sleep_level(sleep_level)
        self.enabled = enabled
        self.state = EngineState.ASLEEP if start_asleep else EngineState.AWAKE
        self._clock = clock
        self.timings: dict[str, float] = {}
        self.transitions: list[str] = []

    @property
    def weights_discarded(self) -> bool:
        """Asleep at level 2: the engine holds no weights and every weight must be pushed after waking."""
        return self.state is EngineState.ASLEEP and self.sleep_level == 2

    def _require(self, action: str, *allowed: EngineState) -> None:
        if self.state not in allowed:
            expected = " or ".join(s.value for s in allowed)
            raise LifecycleError(f"cannot {action} while the engine is {self.state.value} (expected {expected}).")

    def _run(self, action: str, call: Callable[[], object] | None) -> None:
        start = self._clock()
        if self.enabled and call is not None:
            call()
        self.timings[action] = self._clock() - start
        self.transitions.append(action)

    def wake_weights(self) -> None:
        """Map the weights back (level 1: copied from host RAM; level 2: fresh buffers to push weights into)."""
        if self.state is not EngineState.ASLEEP:
            return  # already awake (e.g. an engine that never slept): nothing to do
        self._run("wake_weights", lambda: self.llm.wake_up(tags=["weights"]))
        self.state = EngineState.WEIGHTS_AWAKE

    def wake_kv_cache(self) -> None:
        self._require("wake the KV cache", EngineState.WEIGHTS_AWAKE, EngineState.AWAKE)
        if self.state is EngineState.WEIGHTS_AWAKE:
            self._run("wake_kv_cache", lambda: self.llm.wake_up(tags=["kv_cache"]))
            self.state = EngineState.AWAKE

    def begin_generation(self) -> None:
        """Reset the prefix cache (its entries were computed with the previous weights) and start generating."""
        self._require("generate", EngineState.AWAKE)
        # Always, also without sleep mode: stale cached prefixes would otherwise be reused after a weight update.
        self.llm.reset_prefix_cache()
        self.transitions.append("reset_prefix_cache")
        self.state = EngineState.GENERATING

    def sleep(self) -> None:
        """Put an awake, idle engine to sleep (after creation: it loaded the checkpoint, nothing generates yet)."""
        self._require("sleep", EngineState.AWAKE, EngineState.WEIGHTS_AWAKE)
        self._run("sleep", lambda: self.llm.sleep(level=self.sleep_level))
        self.state = EngineState.ASLEEP

    def end_generation(self, sleep: bool = True) -> None:
        self._require("end generation", EngineState.GENERATING)
        if sleep:
            self._run("sleep", lambda: self.llm.sleep(level=self.sleep_level))
            self.state = EngineState.ASLEEP
        else:
            self.state = EngineState.AWAKE
