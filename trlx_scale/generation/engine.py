"""The rollout engine as an interface: what a trainer asks of whatever generates its rollouts.

Trainers talk to ``RolloutEngine`` only and build it with ``build_engine``; two engines implement it:
``kind="colocate"`` (``ColocatedVLLMGeneration``: vLLM in the training processes, sleep/wake, LoRA-only sync, its
weights through ``weight_transport.InProcessTransport``) and ``kind="server"`` (``ServerGeneration``: vLLM servers
fed by the asynchronous producer, its weights through ``server_weight_transports``: files, an adapter per version,
or NCCL).

The contract:

- ``generate(prompts, images, num_generations)``: sample ``num_generations`` completions per prompt (each group's
  prompt sent once), seeded per request once ``set_rollout_seed`` was called; TRL's return value
  ``(prompt_ids, completion_ids, logprobs, extra)``. It serves the trainer's current policy version (the engine asks
  its ``policy_version`` source and calls ``ensure_version`` itself), so it never generates with stale weights;
- ``ensure_version(version)``: bring the engine's weights to ``version`` if it does not serve it yet (the one place
  that answers "is the engine current"); ``served_version`` is what it serves (None before the first sync);
- ``sequence_logprobs(sequences, use_adapter)``: log-probs of given token sequences (DPO's reference scoring);
- ``sleep``/``wake`` are the engine's own business (``lifecycle``): between rollouts it holds no device memory that
  training needs;
- ``pop_metrics()``: the metrics of the rounds since the last call (``sync/*``, ``generation/*``, ``lifecycle/*``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ..profiling.phase_timer import PhaseTimer
from .colocated_generation import ColocatedVLLMGeneration
from .engine_fields import engine_options
from .server_generation import ServerGeneration


@runtime_checkable
class RolloutEngine(Protocol):
    """What trainers call on an engine (see the module docstring)."""

    served_version: int | None
    phase_timer: PhaseTimer
    excluded_parameter_prefixes: tuple[str, ...]
    # Whether the engine's weights and KV cache live in the training processes' memory (the colocated engine) or on
    # devices of their own (servers): the memory planner counts the first only.
    in_training_processes: bool

    def generate(self, prompts: list, images: Any, num_generations: int, profiler: Any = None) -> tuple: ...

    def set_rollout_seed(self, seed: int, step: int, mode: str = "train") -> None: ...

    def ensure_version(self, version: int) -> bool: ...

    def sequence_logprobs(self, sequences: list[list[int]], use_adapter: bool = False) -> list[list[float]]: ...

    def pop_metrics(self) -> dict[str, float]: ...


ENGINE_KINDS = ("colocate", "server")


def build_engine(
    args: Any,
    *,
    model: Any,
    accelerator: Any,
    processing_class: Any,
    policy_version: Callable[[], int],
    phase_timer: PhaseTimer | None = None,
    kind: str = "colocate",
    **settings: Any,
) -> RolloutEngine:
    """The engine for ``args``: trlx_scale's engine fields (their plain-TRL meaning for a TRL config), plus
    ``settings``, the arguments the trainer decides (sampling, lengths, batch). ``policy_version`` returns the
    trainer's current policy version; ``phase_timer`` is the trainer's profiler (a weight sync is its own phase).

    ``kind="server"``: vLLM servers (``ServerGeneration``), with ``settings`` its parts as the asynchronous trainer
    builds them: the client, the producer and its staleness schedule, the weight transport, the probe."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"engine kind must be one of {ENGINE_KINDS}, got {kind!r}.")
    if kind == "server":
        engine = ServerGeneration(model=model, accelerator=accelerator, policy_version=policy_version, **settings)
        if phase_timer is not None:
            engine.phase_timer = phase_timer
        return engine
    options = {**engine_options(args, getattr(model, "dtype", None)), **settings}
    engine = ColocatedVLLMGeneration(
        model=model,
        accelerator=accelerator,
        processing_class=processing_class,
        mode="colocate",
        policy_version=policy_version,
        **options,
    )
    if phase_timer is not None:
        engine.phase_timer = phase_timer
    return engine
