"""``GRPOConfig``: TRL's config plus the trlx_scale fields (off, or the same objective, by default)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig as TRLGRPOConfig

from ..agents.agent_fields import AgentFields
from ..auto_switch import SWITCH_SETTINGS, switch_setting
from ..config_fields import (
    HubFields,
    ProfilingFields,
    ReliabilityFields,
)
from ..generation.engine_fields import ColocatedEngineFields
from ..losses.policy_losses import LEVELS
from ..losses.recipes import LENGTH_WEIGHTED_LOSSES, RECIPES, apply_recipe
from ..optim.preset_fields import OptimizerPresetFields
from ..passes.packing_fields import PackingFields
from ..trl_config_upgrade import registers_options
from .dynamic_sampling_fields import DynamicSamplingFields
from .overlong_penalty import OverlongPenaltyFields


# A plain TRL config keeps each sample on the rank that generated it, as TRL does.
@registers_options(
    plain_trl_defaults={"balance_ranks": "false", "shared_prefix": "false"}, derived={"loss_recipe_values": None}
)
@dataclass
class GRPOConfig(
    DynamicSamplingFields,
    OverlongPenaltyFields,
    AgentFields,
    ColocatedEngineFields,
    OptimizerPresetFields,
    PackingFields,
    ProfilingFields,
    ReliabilityFields,
    HubFields,
    TRLGRPOConfig,
):
    r"""
    Configuration for [`trlx_scale.GRPOTrainer`]: every field of [`trl.GRPOConfig`], same names, same defaults, same
    meaning, plus the fields below. While they keep their defaults the trainer optimises what TRL's does (the
    defaults' packed rows (`padding_free`) and samples dealt to the ranks (`balance_ranks`): the same losses up to float rounding).

    Each field's documentation is its `help` metadata (what `--help` prints and docs/configuration.md is generated
    from), written once:

    - engine fields shared with `DPOConfig`/`PPOConfig` (`ColocatedEngineFields`): `vllm_cpu_kvcache_space`,
      `vllm_dtype`, `vllm_enforce_eager`, `vllm_sync_mode`, `vllm_sleep_level`, `vllm_sync_bucket_mb`;
    - optimizer fields shared with them (`OptimizerPresetFields`): `optim_preset`, `fp32_master_weights`;
    - packing fields shared with them (`PackingFields`): `padding_free`, `max_tokens_per_microbatch`;
    - multi-turn tool calls (`AgentFields`): `tool_scheduling`, `tool_timeout`;
    - DAPO's dynamic sampling (`DynamicSamplingFields`): `dynamic_sampling` and its bounds;
    - DAPO's soft overlong punishment (`OverlongPenaltyFields`): `overlong_buffer_length`, `overlong_penalty_factor`;
    - GRPO's own: `offload_optimizer_during_generation`, `loss_recipe` (`"gspo"`), `shared_prefix`,
      `old_logprobs_from_loss_pass`, `balance_ranks`; and
      `importance_sampling_level` also accepts `"sequence_token"` (GSPO-token).
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
        default="auto",
        metadata={
            "help": "Process each group's prompt once in the old-policy, reference and loss passes and reuse its "
            "key/value states for the group's G completions (exact up to float rounding). 'auto' (default: the GRPO "
            "step benchmark's step 3.4x faster than 'false', 8.85 s against 30.24 s, docs/benchmarks.md): on where "
            "valid and useful (full-attention decoder, num_generations > 1, no Liger loss, non-reentrant "
            "checkpointing, no max_tokens_per_microbatch bound), else off with the reason logged once; with several "
            "processes every rank takes the same pass for each chunk; 'true': on, or an error naming what prevents "
            "it; 'false': TRL's duplicated pass.",
            "choices": ["false", "true", "auto"],
        },
    )
    balance_ranks: str = field(
        default="auto",
        metadata={
            "help": "With several processes and padding-free rows: once a rollout is scored, deal its samples to the "
            "ranks so that each rank's loss pass costs about the same (longest first by the packed-row cost, every "
            "rank keeping its count of samples; a GRPO group stays together where ranks hold whole groups; nothing "
            "moves unless the costliest rank's cost falls by more than 1 percent), instead of each sample staying "
            "on the rank that generated it. The gradient is unchanged; refused where it would not be: loss_type "
            "'bnpo', top_entropy_quantile below 1, the entropy bonus, a router's load-balancing loss, "
            "gradient_accumulation_steps not a multiple of steps_per_generation, PPO; rollouts with image inputs "
            "stay put. 'auto' (default: the same gradient, and under 2-process ZeRO-3 a 4 percent faster step with "
            "the ranks balanced, docs/benchmarks.md): on where it applies, else off with the reason logged once; "
            "'true': on, or an error naming what prevents it; 'false': TRL's placement.",
            "choices": list(SWITCH_SETTINGS),
        },
    )
    old_logprobs_from_loss_pass: bool = field(
        default=True,
        metadata={
            "help": "With vLLM's importance-sampling correction on and generation aligned with optimizer steps "
            "(gradient_accumulation_steps a multiple of steps_per_generation x num_iterations), the loss pass runs "
            "with the weights that generated the batch, so its detached log-probs are the old-policy log-probs. "
            "True: skip TRL's separate old-policy pass over the batch and compute the correction and its sampling/* "
            "metrics in the loss pass (the same quantities up to float rounding; one forward pass less per "
            "generation: a faster step, measured in docs/benchmarks.md). False: TRL's extra pass. Unaligned "
            "runs, and PPO (its rollout needs the old log-probs for the KL rewards), always take TRL's pass.",
        },
    )

    def __post_init__(self) -> None:
        # Before TrainingArguments.__post_init__, which turns some of these fields into enums.
        self.loss_recipe_values: dict | None = None
        if self.loss_recipe is not None:
            self.loss_recipe_values = apply_recipe(self, self.loss_recipe)
        self.apply_optim_preset()
        super().__post_init__()
        self.validate_engine_fields()
        self.validate_profiling_fields()
        self.validate_reliability_fields()
        self.validate_hub_fields()
        self.validate_packing_fields()
        self.validate_agent_fields()
        self.validate_dynamic_sampling_fields()
        self.validate_overlong_penalty_fields()
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
        self.balance_ranks = switch_setting(
            "balance_ranks", self.balance_ranks, "'auto' moves samples between ranks where the loss allows it"
        )
        self.shared_prefix = switch_setting(
            "shared_prefix", self.shared_prefix, "'auto' shares each group's prompt where the model allows it"
        )
