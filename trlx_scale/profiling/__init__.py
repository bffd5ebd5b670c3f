"""Where a training step's time goes: per-phase timers, token throughput and model FLOPs utilisation.

- ``phase_timer``: exclusive wall-clock timers per phase of a step (a nested phase pauses its parent).
- ``flops``: model FLOPs of forward, training and generation passes from the model's own linear layers.
- ``device_peak``: the device's peak FLOP/s (a table for datacenter GPUs, a short measured matmul on CPU).
- ``trainer_profiling``: ``StepProfiler``, which every trlx_scale trainer holds; it reduces the timings
  across ranks and logs ``time/*``, ``throughput/*`` and ``perf/mfu``.
"""

from .phase_timer import PHASES, PhaseTimer

__all__ = ["PHASES", "PhaseTimer"]
