"""The readable end-of-run summary printed by the examples (steps, reward, accuracy before/after, time)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..atomic_files import write_text_atomically


@dataclass
class RunSummary:
    model: str
    world_size: int = 1
    # Rows of the training split the run trained on (held-out rows excluded).
    train_rows: int | None = None
    steps: int = 0
    train_seconds: float = 0.0
    accuracy_before: float | None = None
    accuracy_after: float | None = None
    # (step, held-out accuracy) measured during the run, before (step 0) and after included: the report's curve.
    accuracy_curve: list[tuple[int, float]] = field(default_factory=list)
    reward_first: float | None = None
    reward_last: float | None = None
    # Every logged mean reward, in order (the learning curve a test or a reader checks).
    reward_curve: list[float] = field(default_factory=list)
    # The largest staleness of any trained sample (asynchronous generation only).
    staleness_max: float | None = None
    sync_logprob_gap_max: float | None = None
    sync_bytes_last: float | None = None
    # The planner's peak for this run and the measured one (rank 0's; host RAM on CPU, the GPU's on CUDA).
    memory_planned_peak_gib: float | None = None
    memory_measured_peak_gib: float | None = None

    def read_log_history(self, log_history: list[dict], global_step: int, reward_key: str = "reward") -> None:
        """Take the first and last logged mean reward from a Trainer's ``state.log_history``."""
        rewards = [entry[reward_key] for entry in log_history if reward_key in entry]
        self.steps = global_step
        if rewards:
            self.reward_first, self.reward_last = rewards[0], rewards[-1]
        self.reward_curve = rewards
        staleness = [entry["async/staleness_max"] for entry in log_history if "async/staleness_max" in entry]
        self.staleness_max = max(staleness) if staleness else None
        gaps = [entry["sync/logprob_gap_max"] for entry in log_history if "sync/logprob_gap_max" in entry]
        self.sync_logprob_gap_max = max(gaps) if gaps else None
        sent = [entry["sync/bytes"] for entry in log_history if "sync/bytes" in entry]
        self.sync_bytes_last = sent[-1] if sent else None
        planned = [entry["memory/planned_peak_gib"] for entry in log_history if "memory/planned_peak_gib" in entry]
        self.memory_planned_peak_gib = planned[-1] if planned else None
        measured_key = "memory/peak_device_gib" if any("memory/peak_device_gib" in e for e in log_history) else None
        measured_key = measured_key or "memory/peak_host_gib"
        measured = [entry[measured_key] for entry in log_history if measured_key in entry]
        self.memory_measured_peak_gib = measured[-1] if measured else None

    def as_dict(self) -> dict:
        return asdict(self)

    def write_json(self, path: str) -> None:
        """Write the summary atomically (temporary file + rename): a reader never sees half a file."""
        write_text_atomically(path, json.dumps(self.as_dict(), indent=2))

    def render(self) -> str:
        def percent(value: float | None) -> str:
            return "n/a" if value is None else f"{100 * value:.1f}%"

        def number(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.3f}"

        lines = [
            "=" * 60,
            f"model            {self.model}",
            f"processes        {self.world_size}",
            f"steps            {self.steps}  ({self.train_seconds:.0f} s training)",
            f"reward           {number(self.reward_first)} (first log) -> {number(self.reward_last)} (last log)",
            f"held-out acc.    {percent(self.accuracy_before)} before -> {percent(self.accuracy_after)} after",
        ]
        if self.accuracy_before is not None and self.accuracy_after is not None:
            lines.append(f"gain             {100 * (self.accuracy_after - self.accuracy_before):+.1f} points")
        if self.sync_logprob_gap_max is not None:
            lines.append(f"vLLM sync        max log-prob gap {self.sync_logprob_gap_max:.1e} (staleness check)")
        if self.memory_planned_peak_gib is not None and self.memory_measured_peak_gib is not None:
            lines.append(
                f"peak memory      {self.memory_measured_peak_gib:.2f} GiB measured, "
                f"{self.memory_planned_peak_gib:.2f} GiB planned (trlx-scale plan)"
            )
        lines.append("=" * 60)
        return "\n".join(lines)
