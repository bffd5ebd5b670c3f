"""``DPOConfig``: TRL's config plus the trlx_scale fields (off, or the same objective, by default)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import DPOConfig as TRLDPOConfig

from ..config_fields import (
    HubFields,
    ProfilingFields,
    ReliabilityFields,
)
from ..generation.engine_fields import ColocatedEngineFields
from ..optim.preset_fields import OptimizerPresetFields
from ..passes.packing_fields import PackingFields
from ..trl_config_upgrade import registers_options


@registers_options()
@dataclass
class DPOConfig(
    ColocatedEngineFields,
    OptimizerPresetFields,
    PackingFields,
    ProfilingFields,
    ReliabilityFields,
    HubFields,
    TRLDPOConfig,
):
    r"""
    Configuration for [`trlx_scale.DPOTrainer`]: every field of [`trl.DPOConfig`], same names, same defaults, same
    meaning, plus the fields below. While they keep their defaults the trainer optimises what TRL's does (the
    defaults' packed rows (`padding_free`): the same losses up to float rounding).
    `padding_free` (TRL 1.16 switches its own off) is trlx_scale's (`PackingFields`): the chosen and rejected
    forwards on packed rows.

    > Parameters added by trlx_scale

    vllm_ref_log_probs (`bool`, *optional*, defaults to `False`):
        Compute the reference log-probs of every chosen and rejected completion once, before training, with the
        colocated vLLM engine (`prompt_logprobs`), instead of TRL's forward passes; the engine sleeps afterwards.
    online (`bool`, *optional*, defaults to `False`):
        Online (iterative) DPO: the dataset holds prompts; every step the current policy samples
        `online_num_generations` completions per prompt through the colocated engine, `reward_funcs` score them, and
        the best and the worst form the pair DPO trains on.
    online_num_generations, online_temperature, online_max_completion_length:
        Sampling of the online rounds.
    vllm_gpu_memory_utilization, vllm_enable_sleep_mode, vllm_max_model_length:
        As in `GRPOConfig` (TRL's GRPO fields of the same names).
    The engine fields (`vllm_dtype`, `vllm_sync_mode`, ...) and `optim_preset` / `fp32_master_weights` are shared
    with `GRPOConfig` (docs/configuration.md).
    """

    vllm_ref_log_probs: bool = field(
        default=False,
        metadata={
            "help": "Precompute the reference log-probs of every chosen/rejected completion with the colocated vLLM "
            "engine (prompt_logprobs) before training, then put the engine to sleep. Implies "
            "precompute_ref_log_probs; the reference is the initial policy (for a LoRA policy: the base)."
        },
    )
    online: bool = field(
        default=False,
        metadata={
            "help": "Online (iterative) DPO: each step the current policy samples online_num_generations "
            "completions per prompt with the colocated vLLM engine (LoRA-only sync, sleep/wake), reward_funcs rank "
            "them, and DPO trains on (best, worst) pairs. The dataset then needs only a 'prompt' column (plus the "
            "columns the reward functions read)."
        },
    )
    online_num_generations: int = field(
        default=4,
        metadata={"help": "Completions sampled per prompt in an online round (at least 2)."},
    )
    online_temperature: float = field(
        default=1.0,
        metadata={"help": "Sampling temperature of the online rounds."},
    )
    online_max_completion_length: int = field(
        default=64,
        metadata={"help": "Maximum tokens of a completion sampled in an online round."},
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3,
        metadata={"help": "Fraction of the GPU memory the colocated engine may take (TRL's GRPO field)."},
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={
            "help": "Let the engine sleep between uses (weights and KV cache released) so training gets the memory "
            "back; needs a platform with vLLM sleep mode (CUDA)."
        },
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={"help": "Context length of the engine. Unset: max_length (offline) or prompt + completion."},
    )

    def __post_init__(self) -> None:
        self.apply_optim_preset()
        if self.vllm_ref_log_probs:
            self.precompute_ref_log_probs = True  # TRL then reads the reference log-probs from the batches
        super().__post_init__()
        self.validate_engine_fields()
        self.validate_profiling_fields()
        self.validate_reliability_fields()
        self.validate_hub_fields()
        self.validate_packing_fields()
        if self.online and self.online_num_generations < 2:
            raise ValueError(
                f"online_num_generations must be at least 2 to form a (chosen, rejected) pair, got "
                f"{self.online_num_generations}."
            )
        if self.online and not self.online_temperature > 0:
            raise ValueError(
                f"online_temperature must be positive (sampling temperature of the online completions; 1.0 samples the "
                f"policy as it is), got {self.online_temperature}."
            )
        if self.online and self.online_max_completion_length < 1:
            raise ValueError(
                f"online_max_completion_length must be at least 1 token, got {self.online_max_completion_length}."
            )
        if self.online and self.vllm_ref_log_probs:
            raise ValueError(
                "vllm_ref_log_probs precomputes reference log-probs of a fixed dataset, but online=True generates "
                "new completions every step; set vllm_ref_log_probs=False (the reference is computed per batch)."
            )
        if self.online and self.ld_alpha is not None:
            raise ValueError("online=True does not support ld_alpha; leave ld_alpha unset.")
        if self.vllm_ref_log_probs and self.ld_alpha is not None:
            raise ValueError("vllm_ref_log_probs sums whole-completion log-probs; leave ld_alpha unset to use it.")

    @property
    def uses_engine(self) -> bool:
        return self.online or self.vllm_ref_log_probs
