"""``StepProfiler``: per-phase step times, token throughput and MFU in every trlx_scale trainer's logs.

Each process times its own phases (``PhaseTimer``; the trainers open the phases where the work happens) and counts
its tokens and model FLOPs (``flops``). At each logging step the records of the steps since the last log are reduced
across ranks in one pair of collectives: times by MAX (a data-parallel step lasts as long as its slowest rank),
tokens and FLOPs by SUM (the job's work). Logged, as means over those steps:

- ``time/step`` and ``time/<phase>`` for every phase that took time (``PHASES``); ``time/other`` is the step's rest
  (data loading, logging, checkpoints, the scheduler; an evaluation run between steps counts there too);
- ``throughput/generated_tokens_per_s`` and ``throughput/trained_tokens_per_s``: the job's tokens per second of
  step wall time (all ranks' tokens over the slowest rank's time);
- ``perf/mfu``: the job's model FLOPs / (step time x processes x the device's peak) (``device_peak``), and
  ``perf/tflops_per_device``;
- ``time/profiler_fraction``: the profiler's own bookkeeping (FLOPs counting, step records, the reduction) over the
  step time, measured on each rank (max).

Phases are "exclusive": a phase opened inside another pauses it, so their sum is the step. Under DeepSpeed the
optimizer step runs inside ``accelerator.backward`` and counts as ``loss_forward_backward``.
``profile_phases=False`` turns everything off (no timers, no collective).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainerCallback

from ..trainer_part import TrainerPart
from .device_peak import device_peak_tflops
from .flops import ModelFlops, generation_flops
from .phase_timer import PHASES, PhaseTimer

COUNTERS: tuple[str, ...] = ("generated_tokens", "trained_tokens", "flops")


@dataclass
class StepRecord:
    """One optimizer step as this process saw it."""

    seconds: float
    phases: dict[str, float]
    counters: dict[str, float] = field(default_factory=dict)


class StepProfiler(TrainerPart):
    """Times the phases of every step: the trainer's component (``trlx_scale.trainer_features`` builds it before
    TRL's ``__init__``, since DPO scores its reference log-probs there, and calls ``start`` after it). The trainer
    wraps each ``training_step`` in ``profiled_step`` and adds ``log_metrics`` to every log; the trainers' rollout
    and passes call ``count_generation`` and ``count_logprob_pass``."""

    def __init__(self, trainer: Any, config: Any):
        super().__init__(trainer)
        self.phase_timer = PhaseTimer(enabled=bool(config.profile_phases))
        self._step_records: list[StepRecord] = []
        self.setup_phases: dict[str, float] = {}  # what ran before training (DPO's reference scoring)
        self._profiler_seconds = 0.0
        self.flops_shape: ModelFlops | None = None
        self.pending_passes: list[tuple[torch.Tensor, bool, float]] = []  # (row lengths, training, token ratio)
        self.peak_tflops: float | None = None

    def start(self) -> None:
        """After TRL's ``__init__``: the model exists; the step clock joins the trainer's callbacks."""
        if self.phase_timer.enabled:
            self.trainer.add_callback(_StepClock(self.trainer))

    # ---------------------------------------------------------------- what the trainers call
    @contextmanager
    def _bookkeeping(self):
        """Time spent on profiling itself (reported as time/profiler_fraction)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._profiler_seconds += time.perf_counter() - start

    def _model_flops(self) -> ModelFlops:
        if self.flops_shape is None:
            trainer = self.trainer
            self.flops_shape = ModelFlops.of(trainer.accelerator.unwrap_model(trainer.model))
        return self.flops_shape

    def count_logprob_pass(self, row_lengths: torch.Tensor, training: bool, token_ratio: float = 1.0) -> None:
        """FLOPs (and trained tokens) of a log-prob pass over rows of these real lengths, as the pass reports them
        (``passes.PassResult``). ``token_ratio`` > 1: the pass processed that many times fewer tokens than the rows
        hold (a shared prefix). The lengths stay on the device until the step ends (no device sync in the pass)."""
        if not self.phase_timer.enabled:
            return
        with self._bookkeeping():
            self.pending_passes.append((row_lengths.detach(), training, token_ratio))

    def _count_pending_passes(self) -> None:
        shape = self._model_flops()
        for lengths_tensor, training, token_ratio in self.pending_passes:
            lengths = lengths_tensor.tolist()
            flops = shape.training_flops(lengths) if training else shape.forward_flops(lengths)
            self.phase_timer.count("flops", flops / token_ratio)
            if training:
                self.phase_timer.count("trained_tokens", sum(lengths) / token_ratio)
        self.pending_passes = []

    def count_generation(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> None:
        """Tokens and FLOPs of one generation call (each distinct prompt prefilled once: prefix cache, n=G)."""
        if not self.phase_timer.enabled:
            return
        with self._bookkeeping():
            unique = {tuple(p) for p in prompt_ids}
            rows = [(len(p), len(c)) for p, c in zip(prompt_ids, completion_ids, strict=True)]
            flops = generation_flops(self._model_flops(), [len(p) for p in unique], rows)
            self.phase_timer.count("flops", flops)
            self.phase_timer.count("generated_tokens", sum(len(c) for c in completion_ids))

    # ---------------------------------------------------------------- the Trainer's loop
    @contextmanager
    def profiled_step(self):
        """Around one micro-batch's training step (``TrainerFeatures.training_step``)."""
        with self.phase_timer.phase("loss_forward_backward"):
            yield
        if self.trainer.accelerator.sync_gradients:
            self.phase_timer.begin("optimizer")  # clipping and the step; closed by _StepClock.on_optimizer_step

    def close_step(self, seconds: float) -> None:
        with self._bookkeeping():
            self._count_pending_passes()
            phases, counters = self.phase_timer.take()
            phases["other"] = phases.get("other", 0.0) + max(seconds - sum(phases.values()), 0.0)
            self._step_records.append(StepRecord(seconds, phases, counters))

    def _profile_metrics(self) -> dict[str, float]:
        """Reduce the records since the last log across ranks (collective: every rank calls it at the same log)."""
        records, self._step_records = self._step_records, []
        if not records:
            return {}
        overhead, self._profiler_seconds = self._profiler_seconds, 0.0
        accelerator = self.trainer.accelerator
        return summarize_steps(records, accelerator.num_processes, self.peak_tflops, overhead, accelerator.device)

    def log_metrics(self, logs: dict[str, float]) -> dict[str, float]:
        """The profile of the steps since the last log (a collective: every rank logs at the same steps)."""
        if not self.phase_timer.enabled or any(key.startswith("eval_") for key in logs):
            return {}
        extra = self._profile_metrics()
        if self.setup_phases:
            extra.update({f"time/{name}": seconds for name, seconds in self.setup_phases.items()})
            self.setup_phases = {}
        return extra


class _StepClock(TrainerPart, TrainerCallback):
    """Marks the step boundaries: train begin, the optimizer step, each step's end.

    It holds the trainer weakly: a trainer -> callback -> trainer cycle would leave a finished trainer (and its vLLM
    engine) to the cyclic garbage collector, which may then tear the engine's process groups down in the middle of
    the next engine's start-up.
    """

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        self.step_started: float | None = None

    @property
    def profiler(self) -> StepProfiler:
        return self.trainer.profiler

    def on_train_begin(self, args, state, control, **kwargs):
        trainer, profiler = self.trainer, self.profiler
        # What ran before training (DPO's reference scoring) is logged once, with the first step's metrics.
        phases, _ = profiler.phase_timer.take()
        profiler.setup_phases = {name: seconds for name, seconds in phases.items() if seconds > 0}
        profiler.pending_passes = []  # passes before training are not a step's work
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        dtype = next((p.dtype for p in unwrapped.parameters() if p.requires_grad), torch.float32)
        profiler.flops_shape = ModelFlops.of(unwrapped)
        profiler.peak_tflops = device_peak_tflops(trainer.accelerator.device, dtype, trainer.args.peak_tflops)
        self.step_started = profiler.phase_timer.clock()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.profiler.phase_timer.end("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        now = self.profiler.phase_timer.clock()
        if self.step_started is not None:
            self.profiler.close_step(now - self.step_started)
        self.step_started = now


def summarize_steps(
    records: list[StepRecord],
    world: int,
    peak_tflops: float | None,
    profiler_seconds: float,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """The logged metrics of these steps. With ``world > 1`` this is a collective (every rank passes its own
    records for the same steps): times are MAX-reduced, tokens and FLOPs SUM-reduced."""
    start = time.perf_counter()
    times = torch.tensor(
        [[r.phases.get(p, 0.0) for p in PHASES] + [r.seconds] for r in records], dtype=torch.float64, device=device
    )
    counters = torch.tensor(
        [[r.counters.get(c, 0.0) for c in COUNTERS] for r in records], dtype=torch.float64, device=device
    )
    overhead = torch.tensor([profiler_seconds], dtype=torch.float64, device=device)
    if world > 1:
        torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX)
        torch.distributed.all_reduce(counters, op=torch.distributed.ReduceOp.SUM)
        torch.distributed.all_reduce(overhead, op=torch.distributed.ReduceOp.MAX)
    times, counters = times.cpu(), counters.cpu()
    step_total = float(times[:, -1].sum())
    metrics = {"time/step": step_total / len(records)}
    for column, name in enumerate(PHASES):
        total = float(times[:, column].sum())
        if total > 0 or name == "other":
            metrics[f"time/{name}"] = total / len(records)
    totals = dict(zip(COUNTERS, counters.sum(dim=0).tolist(), strict=True))
    if step_total > 0:
        metrics["throughput/generated_tokens_per_s"] = totals["generated_tokens"] / step_total
        metrics["throughput/trained_tokens_per_s"] = totals["trained_tokens"] / step_total
        per_device = totals["flops"] / step_total / world / 1e12
        metrics["perf/tflops_per_device"] = per_device
        if peak_tflops:
            metrics["perf/mfu"] = per_device / peak_tflops
        metrics["time/profiler_fraction"] = (float(overhead[0]) + time.perf_counter() - start) / step_total
    return metrics
