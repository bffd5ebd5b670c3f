"""``PPOConfig``: GRPOConfig (TRL's GRPO fields + trlx_scale's) plus the actor-critic fields of PPO."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..grpo.config import GRPOConfig
from ..trl_config_upgrade import registers_options


@registers_options()
@dataclass
class PPOConfig(GRPOConfig):
    r"""
    Configuration for [`trlx_scale.PPOTrainer`]. Rollouts, rewards, the colocated engine and the policy loss use the
    GRPO fields (`num_generations` samples per prompt, `epsilon` clipping, `importance_sampling_level` for token or
    sequence (GSPO) ratios); PPO's epochs and mini-batches are TRL's `num_iterations` and `steps_per_generation`.
    The fields below add the critic, GAE and the KL penalty folded into the rewards. `beta` (TRL's KL term in the
    loss) must stay 0: PPO's KL lives in the rewards (`kl_coef`).

    > Parameters added for PPO

    kl_coef (`float`, defaults to `0.2`): initial coefficient of the per-token KL penalty in the rewards.
    adaptive_kl (`bool`, defaults to `True`): adapt `kl_coef` towards `kl_target` (Ziegler et al. 2019).
    kl_target (`float`, defaults to `6.0`), kl_horizon (`int`, defaults to `10000`): the controller's target KL (nats
        per sequence) and horizon (sequences).
    kl_estimator (`str`, defaults to `"k1"`): `"k1"` (log-ratio) or `"k3"`.
    gamma (`float`, defaults to `1.0`), lam (`float`, defaults to `0.95`): GAE discount and lambda.
    step_reward_credit (`str`, defaults to `"sequence_end"`): with `rollout_func=GymRollout(...)`, where each
        environment step's reward enters the per-token rewards: `"sequence_end"` or `"own_turn"`.
    whiten_advantages (`bool`, defaults to `True`): normalize advantages over the batch's completion tokens.
    cliprange_value (`float`, defaults to `0.2`), vf_coef (`float`, defaults to `0.1`): value-loss clipping and weight.
    target_kl (`float` or `None`): stop the remaining updates on a rollout once a mini-batch's approximate KL to the
        rollout policy exceeds 1.5 x this.
    critic_mode (`str`, defaults to `"separate"`): `"separate"` (own model) or `"shared_base"` (second LoRA adapter on
        the policy's base; LoRA policies only).
    value_model_name_or_path (`str` or `None`): initial weights of a separate critic (default: the policy's).
    critic_use_peft (`bool`, defaults to `False`): train a separate critic through LoRA (the policy's LoRA config).
    critic_learning_rate (`float` or `None`): the critic optimizer's learning rate (default: the `ppo_critic`
        preset's); its other AdamW settings always come from that preset.
    """

    kl_coef: float = field(
        default=0.2, metadata={"help": "Initial coefficient of the per-token KL penalty folded into the rewards."}
    )
    adaptive_kl: bool = field(
        default=True,
        metadata={"help": "Adapt kl_coef towards kl_target with the proportional controller of Ziegler et al. 2019."},
    )
    kl_target: float = field(
        default=6.0, metadata={"help": "Target KL (nats per sequence) of the adaptive KL controller."}
    )
    kl_horizon: int = field(default=10000, metadata={"help": "Horizon (in sequences) of the adaptive KL controller."})
    kl_estimator: str = field(
        default="k1",
        metadata={
            "help": "Per-token KL estimator in the rewards: 'k1' (log pi - log pi_ref) or 'k3' (non-negative).",
            "choices": ["k1", "k3"],
        },
    )
    gamma: float = field(default=1.0, metadata={"help": "GAE discount factor over completion tokens."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda (bias/variance trade-off of the advantages)."})
    step_reward_credit: str = field(
        default="sequence_end",
        metadata={
            "help": "With rollout_func=GymRollout(...): where each environment step's reward enters the per-token "
            "rewards. 'sequence_end': the <Env>_turns reward column (the steps' rewards discounted by "
            "turn_reward_discount and summed) on the trajectory's last sampled token, like every other reward "
            "column, as GRPO scores it. 'own_turn': each step's reward on the last sampled token of the turn that "
            "earned it (times that column's reward weight), and turn_reward_discount applied between turns in GAE "
            "besides gamma, so a turn's advantage counts its own and later steps' rewards, not earlier ones. Default "
            "'sequence_end': the trajectory reward TRL and GRPO give; the two have not been compared for learning "
            "on this machine (the embedded tasks have no per-step reward).",
            "choices": ["sequence_end", "own_turn"],
        },
    )
    whiten_advantages: bool = field(
        default=True, metadata={"help": "Normalize the advantages to zero mean and unit variance over the batch."}
    )
    cliprange_value: float = field(
        default=0.2, metadata={"help": "Clip range of the value loss around the values at rollout time."}
    )
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss added to the policy loss."})
    target_kl: float | None = field(
        default=None,
        metadata={
            "help": "Early stop: skip the remaining PPO updates on a rollout once a mini-batch's approximate KL to "
            "the rollout policy exceeds 1.5 x target_kl. Unset: never."
        },
    )
    critic_mode: str = field(
        default="separate",
        metadata={
            "help": "'separate': the critic is its own model (full or LoRA). 'shared_base': a second LoRA adapter on "
            "the policy's frozen base plus a value head (one base in memory for actor, critic and reference; needs "
            "a LoRA policy).",
            "choices": ["separate", "shared_base"],
        },
    )
    value_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Initial weights of a separate critic (a causal LM checkpoint). Unset: the policy's."},
    )
    critic_use_peft: bool = field(
        default=False,
        metadata={"help": "Train a separate critic through LoRA (the policy's LoRA config) instead of fully."},
    )
    critic_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Learning rate of the critic's optimizer. Unset: the ppo_critic preset's (1e-6)."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dynamic_sampling:
            raise ValueError(
                "dynamic_sampling drops GRPO groups whose rewards are all equal; PPO's advantages come from its critic "
                "(GAE), not from groups, so no sample is without signal there. Set dynamic_sampling=False."
            )
        if self.beta != 0.0:
            raise ValueError(
                f"PPO folds the KL penalty into the rewards (kl_coef); beta={self.beta} would add TRL's KL term to "
                "the loss as well. Set beta=0 and use kl_coef."
            )
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {self.kl_estimator!r}.")
        if self.critic_mode not in ("separate", "shared_base"):
            raise ValueError(f"critic_mode must be 'separate' or 'shared_base', got {self.critic_mode!r}.")
        if self.critic_mode == "shared_base":
            # The critic's adapter and value head are parameters of the policy's DDP module used outside its forward.
            # DDP's unused-parameter search would mark them ready (unused) after the forward, then again when the
            # value loss's gradients reach them: "Expected to mark a variable ready only once". Every trainable
            # parameter gets a gradient in each step (policy and value loss share one backward), so it is not needed.
            if self.ddp_find_unused_parameters:
                raise ValueError(
                    "critic_mode='shared_base' trains the critic adapter inside the policy's DDP module but outside "
                    "its forward, which ddp_find_unused_parameters=True cannot handle: leave ddp_find_unused_parameters "
                    "unset (or False)."
                )
            self.ddp_find_unused_parameters = False
        if self.step_reward_credit not in ("sequence_end", "own_turn"):
            raise ValueError(
                f"step_reward_credit must be 'sequence_end' or 'own_turn', got {self.step_reward_credit!r}."
            )
        if not 0.0 <= self.lam <= 1.0 or not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={self.gamma}, lam={self.lam}.")
        if self.kl_target <= 0 or self.kl_horizon <= 0:
            raise ValueError("kl_target and kl_horizon must be positive.")
        if self.kl_coef < 0:
            raise ValueError(
                f"kl_coef must be >= 0 (a negative KL penalty rewards drifting from the reference), got {self.kl_coef}."
            )
        for name, hint in (
            ("vf_coef", "the value loss' weight; 0 would never train the critic"),
            ("cliprange_value", "the value clipping range, e.g. 0.2"),
            ("critic_learning_rate", "unset it to take the ppo_critic preset's"),
            ("target_kl", "unset it to never stop early"),
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number ({hint}), got {value}.")
