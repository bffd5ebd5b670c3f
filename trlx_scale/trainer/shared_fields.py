"""Config fields shared by the trlx_scale trainers: the colocated vLLM engine and the optimizer presets.

Mixed into each trainer's config (``GRPOConfig``, ``DPOConfig``) ahead of TRL's class, so a field means the same
thing, with the same default and check, in every trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..optim.presets import PRESETS

SYNC_MODES = ("auto", "lora", "full")
SLEEP_LEVELS = ("auto", "1", "2")
ENGINE_DTYPES = ("auto", "trainer", "bfloat16", "float16", "float32")


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
        default="auto",
        metadata={
            "help": "Weight dtype of the colocated vLLM engine: 'auto' (vLLM decides; TRL's behaviour, bf16 on CPU "
            "even for fp32 checkpoints), 'trainer' (the trainer's compute dtype), or 'bfloat16'/'float16'/'float32'.",
            "choices": ["auto", "trainer", "bfloat16", "float16", "float32"],
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
            "'full' (every weight, merged), or 'auto' ('lora' when vLLM can serve the policy's adapter, else "
            "'full', with the reason logged once).",
            "choices": ["auto", "lora", "full"],
        },
    )
    vllm_sleep_level: str = field(
        default="auto",
        metadata={
            "help": "Sleep level of the colocated engine when vllm_enable_sleep_mode is on: '1' keeps its weights in "
            "host RAM, '2' discards them (all weights re-sent after waking); 'auto' = 1 with LoRA-only sync, 2 with "
            "full sync.",
            "choices": ["auto", "1", "2"],
        },
    )
    vllm_sync_bucket_mb: float = field(
        default=256.0,
        metadata={"help": "A full weight sync gathers (ZeRO-3/FSDP) and pushes this many MB of parameters at a time."},
    )

    def engine_dtype(self) -> str:
        """The dtype string handed to ``vllm.LLM`` for ``vllm_dtype``."""
        if self.vllm_dtype != "trainer":
            return self.vllm_dtype
        if self.bf16 or self.uses_fp32_master_weights:
            return "bfloat16"
        if self.fp16:
            return "float16"
        return "float32"

    def validate_engine_fields(self) -> None:
        """Check the engine fields; called by the configs' ``__post_init__``."""
        self.vllm_sleep_level = str(self.vllm_sleep_level)
        for name, allowed in (("vllm_sync_mode", SYNC_MODES), ("vllm_sleep_level", SLEEP_LEVELS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}.")
        if self.vllm_sync_bucket_mb <= 0:
            raise ValueError(f"vllm_sync_bucket_mb must be positive, got {self.vllm_sync_bucket_mb}.")
        if self.vllm_dtype not in ENGINE_DTYPES:
            raise ValueError(f"vllm_dtype must be one of {ENGINE_DTYPES}, got {self.vllm_dtype!r}.")
        if self.vllm_cpu_kvcache_space <= 0:
            raise ValueError(
                f"vllm_cpu_kvcache_space must be a positive number of GiB, got {self.vllm_cpu_kvcache_space}; "
                "1 is plenty for small models."
            )
