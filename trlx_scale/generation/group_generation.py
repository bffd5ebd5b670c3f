"""Prefix-cached group generation: each unique prompt is sent to vLLM once with ``n`` samples.

TRL's colocate mode sends every row of the batch (each prompt repeated ``num_generations`` times) as its own
request with ``n=1``. GRPO's sampler places a group's copies next to each other, so runs of identical consecutive
prompts are collapsed into one request with ``n`` = the run's length; vLLM then schedules the prompt once and forks
its KV blocks for the samples (with prefix caching on, as it is by default). The outputs are flattened back in the
order of the input rows, which is the order TRL's code expects.

A group split across processes (small per-device batches) simply becomes two shorter runs, one per process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def collapse_runs(prompts: Sequence[Sequence[int]], extras: Sequence[Any] | None = None) -> list[tuple[int, int]]:
    """``(first_row, count)`` for each run of consecutive identical prompts (and identical extras, e.g. images)."""
    runs: list[tuple[int, int]] = []
    for row, prompt in enumerate(prompts):
        if runs:
            first, count = runs[-1]
            same_extra = extras is None or extras[row] is extras[first] or extras[row] == extras[first]
            if list(prompt) == list(prompts[first]) and same_extra:
                runs[-1] = (first, count + 1)
                continue
        runs.append((row, 1))
    return runs


def expand_outputs(runs: Sequence[tuple[int, int]], outputs_per_run: Sequence[Sequence[Any]]) -> list[Any]:
    """Flatten per-run outputs (``count`` samples each) back into one output per input row, in row order."""
    rows: list[Any] = []
    for (first, count), outputs in zip(runs, outputs_per_run, strict=True):
        if len(outputs) != count:
            raise ValueError(f"run starting at row {first} asked for {count} samples, vLLM returned {len(outputs)}.")
        rows.extend(outputs)
    return rows
