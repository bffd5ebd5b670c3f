"""Config fields shared by the trlx_scale trainers: the colocated vLLM engine and the optimizer presets.

Mixed into each trainer's config (``GRPOConfig``, ``DPOConfig``) ahead of TRL's class, so a field means the same
thing, with the same default and check, in every trainer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..generation.engine_options import (
    ENGINE_DTYPES,
    SLEEP_LEVELS,
    SYNC_MODES,
    check_engine_dtype,
    check_kvcache_space,
    check_positive,
    check_sleep_level,
    check_sync_mode,
)
from ..optim.presets import PRESETS, apply_preset, get_preset


def option(args, config_cls: type, name: str):
    """``args.name``, or the field's default in ``config_cls`` when ``args`` is a plain TRL config without it (a
    trlx_scale trainer accepts TRL's configs; then every trlx_scale option keeps its default)."""
    if hasattr(args, name):
        return getattr(args, name)
    return next(f.default for f in dataclasses.fields(config_cls) if f.name == name)


@dataclass
class OptimizerPresetFields:
    """`optim_preset` and `fp32_master_weights` (trlx_scale.optim)."""

    optim_preset: str | None = field(
        default=None,
        metadata={
            "help": "Optimizer hyperparameters tuned for RL: 'grpo', 'grpo_lora', 'ppo_policy', 'ppo_critic', 'dpo' "
            "(AdamW, constant schedule with warmup, betas (0.9, 0.95); docs/optimizers.md). Fills only the optimizer "
            "fields left at their defaults; the effective values are printed at start.",
            "choices": [None, *sorted(PRESETS)],
        },
    )
    fp32_master_weights: bool | None = field(
        default=None,
        metadata={
            "help": "Hold the model in bf16 (compute and the weights sent to vLLM) and keep fp32 master weights and "
            "fp32 Adam moments in the optimizer, so that tiny RL updates are not rounded away. Unset: on when "
            "optim_preset is set. Under FSDP2/ZeRO-3 the sharding engine keeps the masters (docs/optimizers.md)."
        },
    )

    @property
    def uses_fp32_master_weights(self) -> bool:
        return self.optim_preset is not None if self.fp32_master_weights is None else self.fp32_master_weights

    def apply_optim_preset(self) -> None:
        """Fill the optimizer fields left at their defaults from ``optim_preset``; ``optim_preset_values`` records
        each effective value and its source for the trainer's start-up line. Call before TrainingArguments'
        ``__post_init__``, which turns some of these fields into enums."""
        self.optim_preset_values: dict | None = None
        if self.optim_preset is not None:
            self.optim_preset_values = apply_preset(self, get_preset(self.optim_preset))


@dataclass
class ColocatedEngineFields:
    """Options of the colocated vLLM engine (trlx_scale.generation.ColocatedVLLMGeneration)."""

    vllm_cpu_kvcache_space: float = field(
        default=1.0,
        metadata={
            "help": "GiB of host memory for vLLM's KV cache when vLLM runs on CPU (vllm-cpu). Sets "
            "VLLM_CPU_KVCACHE_SPACE unless it is already exported; unset, vLLM reserves most of the RAM. Ignored on "
            "GPUs."
        },
    )
    vllm_dtype: str = field(
        default="trainer",
        metadata={
            "help": "Weight dtype of the colocated vLLM engine: 'trainer' (the trainer's compute dtype: bf16 with "
            "bf16/fp32-master training, fp32 for fp32 training), 'auto' (vLLM decides: TRL's behaviour, bf16 on CPU "
            "even for fp32 checkpoints), or 'bfloat16'/'float16'/'float32'. Default 'trainer', by measurement "
            "(docs/benchmarks.md): its log-probs match the trainer's (gap ~6e-7 against ~4e-3 for a bf16 engine "
            "beside an fp32 trainer), which keeps the staleness check meaningful; on CPU 'auto' (bf16) generates "
            "merged weights faster (a GRPO step 1.2x) and served adapters slower.",
            "choices": list(ENGINE_DTYPES),
        },
    )
    vllm_enforce_eager: bool | None = field(
        default=None,
        metadata={
            "help": "Run the colocated vLLM engine without torch.compile. Unset: eager on CPU (compilation costs "
            "~35 s at start-up there), vLLM's default on GPUs."
        },
    )
    vllm_sync_mode: str = field(
        default="auto",
        metadata={
            "help": "How weights reach the colocated vLLM engine: 'lora' (only the LoRA adapter; vLLM serves it), "
            "'full' (every weight, merged), or 'auto': 'lora' when vLLM can serve the policy's adapter on a GPU; "
            "'full' on CPU engines (vLLM's CPU LoRA kernels cost more per step than a merged sync: measured at 30M "
            "and 0.5B parameters, docs/benchmarks.md) and for adapters vLLM cannot serve, with the reason logged once.",
            "choices": list(SYNC_MODES),
        },
    )
    vllm_sleep_level: str = field(
        default="auto",
        metadata={
            "help": "Sleep level of the colocated engine when vllm_enable_sleep_mode is on: '1' keeps its weights in "
            "host RAM, '2' discards them (all weights re-sent after waking); 'auto' = 1 with LoRA-only sync, 2 with "
            "full sync.",
            "choices": list(SLEEP_LEVELS),
        },
    )
    vllm_per_request_seed: bool = field(
        default=True,
        metadata={
            "help": "Give every vLLM request its own seed, derived from (seed, step, the request's row in the step's "
            "global batch, prompt), so that a step's rollouts depend neither on what the engine sampled before nor on "
            "the number of processes: a run resumed from a checkpoint samples exactly what the uninterrupted run did, "
            "and 2 processes x B/2 sample what 1 x B does. On by default: its cost in a GRPO step's generation is within "
            "noise on CPU (ratio 1.01, docs/benchmarks.md). False: vLLM's engine-wide generator (TRL's behaviour)."
        },
    )
    vllm_sync_bucket_mb: float = field(
        default=256.0,
        metadata={"help": "A full weight sync gathers (ZeRO-3/FSDP) and pushes this many MB of parameters at a time."},
    )

    def engine_dtype(self, model_dtype: torch.dtype | None = None) -> str:
        """The dtype string handed to ``vllm.LLM`` for ``vllm_dtype``. "trainer": bf16/fp16 mixed precision or fp32
        masters (model held in bf16) decide; otherwise the dtype the model's weights are in (``model_dtype``; a model
        loaded in bf16 computes in bf16, so an fp32 engine would only upcast), fp32 when unknown."""
        if self.vllm_dtype != "trainer":
            return self.vllm_dtype
        if self.bf16 or self.uses_fp32_master_weights:
            return "bfloat16"
        if self.fp16:
            return "float16"
        if model_dtype in (torch.bfloat16, torch.float16):
            return str(model_dtype).removeprefix("torch.")
        return "float32"

    def validate_engine_fields(self) -> None:
        """Check the engine fields (the rules live in generation/engine_options.py); called by ``__post_init__``."""
        self.vllm_sleep_level = check_sleep_level(self.vllm_sleep_level)
        check_sync_mode(self.vllm_sync_mode)
        check_engine_dtype(self.vllm_dtype)
        check_positive("vllm_sync_bucket_mb", self.vllm_sync_bucket_mb)
        check_kvcache_space(self.vllm_cpu_kvcache_space)

    def engine_options(self, model_dtype: torch.dtype | None = None) -> dict:
        """The trlx_scale arguments of ``ColocatedVLLMGeneration`` these fields set (see ``from_config``)."""
        return dict(
            dtype=self.engine_dtype(model_dtype),
            enforce_eager=self.vllm_enforce_eager,
            sync_mode=self.vllm_sync_mode,
            sleep_level=self.vllm_sleep_level,
            sync_bucket_mb=self.vllm_sync_bucket_mb,
            per_request_seed=self.vllm_per_request_seed,
        )


@dataclass
class ProfilingFields:
    """Per-phase step profiling (trlx_scale.profiling): ``time/*``, ``throughput/*``, ``perf/mfu`` in the logs."""

    profile_phases: bool = field(
        default=True,
        metadata={
            "help": "Time every phase of each step (generation, weight sync, reward, log-prob passes, loss, "
            "optimizer, ...) on every rank and log the slowest rank's times as time/<phase>, with token throughput "
            "and MFU (docs/profiling.md). Costs well under one percent of a step (logged as time/profiler_fraction)."
        },
    )
    peak_tflops: float | None = field(
        default=None,
        metadata={
            "help": "Peak TFLOP/s of one device, the denominator of perf/mfu. Unset: the bf16 dense peak of known "
            "GPUs (A100, H100, H200, L40S, A10G), a short measured matmul on CPU; MFU is not logged on other GPUs."
        },
    )

    def validate_profiling_fields(self) -> None:
        if self.peak_tflops is not None:
            check_positive("peak_tflops", self.peak_tflops, "It is the TFLOP/s of one device, e.g. 989 for an H100.")


REWARD_ERROR_MODES = ("raise", "skip")


@dataclass
class ReliabilityFields:
    """Fault handling (trlx_scale.reliability): non-finite steps, failing reward functions, checkpoint integrity."""

    max_consecutive_skipped_steps: int = field(
        default=3,
        metadata={
            "help": "A step whose loss or gradient norm is NaN/inf is skipped (gradients dropped; weights, fp32 "
            "masters and Adam moments untouched; vLLM keeps its weights) and counted in reliability/skipped_steps. "
            "After this many skipped steps in a row training stops with an error. 0 turns the guard off."
        },
    )
    reward_errors: str = field(
        default="raise",
        metadata={
            "help": "What a reward function that raises does to the run. 'raise': stop on every rank with an error "
            "naming the function, the sample index and its completion. 'skip': score that sample NaN (as TRL does "
            "with None: the other functions' rewards still count), count it in reliability/reward_errors, go on. "
            "A reward of inf is an error in both modes.",
            "choices": list(REWARD_ERROR_MODES),
        },
    )
    verify_checkpoints: bool = field(
        default=True,
        metadata={
            "help": "Record the size and SHA-256 of every file of a checkpoint in its completion marker and verify "
            "them on resume: a damaged checkpoint given by path is refused naming the file, resume_from_checkpoint="
            "True falls back to the newest intact one. The hashing is split across ranks; its cost per GB is in "
            "docs/benchmarks.md. False: neither recorded nor verified."
        },
    )
    async_checkpoints: bool = field(
        default=False,
        metadata={
            "help": "Under FSDP2 with fsdp_state_dict_type SHARDED_STATE_DICT: write each rank's model and optimizer "
            "shards in the background (torch.distributed.checkpoint.async_save) while training goes on; the "
            "checkpoint counts (completion marker) only once every rank's shards are durable. Off by default: the "
            "background write holds a host-memory copy of this rank's shards until it lands, and its blocking time "
            "is measured on CPU only so far (docs/benchmarks.md). Ignored elsewhere (DeepSpeed writes its own "
            "per-rank files)."
        },
    )
    save_on_preemption: bool = field(
        default=True,
        metadata={
            "help": "On SIGTERM or SIGUSR1 (Slurm's --signal, Kubernetes, spot instances) finish the current step on "
            "every rank (one rank receiving the signal is enough), save a complete checkpoint and exit with code 75 "
            "(TrainingPreempted); a second signal exits at once. Resume with resume_from_checkpoint=True. False: "
            "the signals keep their previous handlers."
        },
    )

    def validate_reliability_fields(self) -> None:
        if not isinstance(self.max_consecutive_skipped_steps, int) or self.max_consecutive_skipped_steps < 0:
            raise ValueError(
                f"max_consecutive_skipped_steps must be an integer >= 0 (0 turns the non-finite guard off), got "
                f"{self.max_consecutive_skipped_steps!r}."
            )
        if self.reward_errors not in REWARD_ERROR_MODES:
            raise ValueError(
                f"reward_errors must be one of {REWARD_ERROR_MODES} ('raise' stops the run, 'skip' scores the sample "
                f"NaN), got {self.reward_errors!r}."
            )


@dataclass
class HubFields:
    """How a run goes to the Hugging Face Hub (trlx_scale.hub): what is pushed, and how failures are retried."""

    push_merged: bool = field(
        default=False,
        metadata={
            "help": "Push the LoRA adapter merged into its base (a plain transformers model: config.json + "
            "model.safetensors) instead of the adapter. Needs the whole model in one process (not DeepSpeed/FSDP)."
        },
    )
    hub_push_retries: int = field(
        default=3,
        metadata={
            "help": "Retries of a Hub upload that failed on the server's side (HTTP 5xx, 429, a dropped connection), "
            "with exponential backoff; then an error saying the run is saved locally. Client errors are not retried."
        },
    )
    hub_push_backoff_s: float = field(
        default=2.0,
        metadata={"help": "Seconds before the first retry of a failed Hub upload; doubled at each retry."},
    )

    def validate_hub_fields(self) -> None:
        if not isinstance(self.hub_push_retries, int) or self.hub_push_retries < 0:
            raise ValueError(f"hub_push_retries must be an integer >= 0, got {self.hub_push_retries!r}.")
        if self.hub_push_backoff_s < 0:
            raise ValueError(f"hub_push_backoff_s must be >= 0 seconds, got {self.hub_push_backoff_s}.")
