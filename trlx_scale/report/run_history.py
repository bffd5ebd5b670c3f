"""A run's logged metrics, read back from its output directory.

The Trainer writes ``trainer_state.json`` (``log_history``: one entry per logging step) at every checkpoint and,
through ``save_state()``, at the end of the examples; the examples also write ``run_summary.json``. The newest of
``OUTPUT_DIR/trainer_state.json`` and ``OUTPUT_DIR/checkpoint-*/trainer_state.json`` is read, so a report can be drawn
from a run that is still going.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field


@dataclass
class RunHistory:
    """Per-step metrics (``log_history`` entries that carry a step) and the run summary, if any."""

    source: str
    entries: list[dict]
    summary: dict = field(default_factory=dict)

    @classmethod
    def load(cls, output_dir: str) -> RunHistory:
        if not os.path.isdir(output_dir):
            raise FileNotFoundError(f"{output_dir} is not a directory: pass a run's output_dir.")
        candidates = [os.path.join(output_dir, "trainer_state.json")]
        candidates += glob.glob(os.path.join(output_dir, "checkpoint-*", "trainer_state.json"))
        existing = [path for path in candidates if os.path.isfile(path)]
        if not existing:
            raise FileNotFoundError(
                f"no trainer_state.json in {output_dir} or its checkpoint-*/ folders: the run has not saved yet. "
                "The examples write it at the end; a Trainer writes it with every checkpoint (save_steps)."
            )
        source = max(existing, key=os.path.getmtime)
        with open(source) as handle:
            state = json.load(handle)
        entries = [e for e in state.get("log_history", []) if "step" in e and "train_runtime" not in e]
        summary = {}
        summary_path = os.path.join(output_dir, "run_summary.json")
        if os.path.isfile(summary_path):
            with open(summary_path) as handle:
                summary = json.load(handle)
        return cls(source=source, entries=entries, summary=summary)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, in logging order."""
        points = [(e["step"], float(e[key])) for e in self.entries if key in e and e[key] is not None]
        return [p[0] for p in points], [p[1] for p in points]

    def first_present(self, keys: tuple[str, ...]) -> str | None:
        """The first of ``keys`` that the run logged."""
        return next((k for k in keys if any(k in e for e in self.entries)), None)
