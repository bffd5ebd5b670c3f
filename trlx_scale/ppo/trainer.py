"""``PPOTrainer``: actor-critic RLHF (PPO with GAE and a KL-penalized reward) on the trlx_scale GRPO machinery.

TRL 1.16 has no PPOTrainer any more. This one subclasses ``trlx_scale.GRPOTrainer`` rather than TRL's base trainer
because everything up to the advantages is the same in PPO: prompts repeated ``num_generations`` times, generation
through the colocated vLLM engine (sleep/wake, LoRA-only sync) or HF generate, reward functions and reward models
(TRL's GRPO scores sequence-classification models on prompt + completion), old-policy log-probs, the clipped policy
loss with token or sequence (GSPO) ratios, ``num_iterations`` epochs over ``steps_per_generation`` mini-batches per
rollout, logging, checkpointing and Hub push. PPO replaces two steps:

- advantages: instead of group-normalized rewards, per-token rewards (the score on the last token, minus
  ``kl_coef`` x KL(policy || reference) on every token) go through GAE with the critic's values, then whitening
  (``trlx_scale.ppo.advantages``); TRL's loss takes ``(batch, tokens)`` advantages as they are;
- loss: the critic's clipped value loss (``losses.clipped_value_loss``) is added with ``vf_coef``; the critic is
  stepped by its own optimizer (``ppo_critic`` preset) right after the policy's.

Where the parts live: the roles and the critic's optimizer options in ``ppo_roles``, values and GAE in
``ppo_advantages``, the critic's checkpoint state in ``ppo_checkpoint_state``; this file holds the loss, the critic's
step and the constructor.

Roles: policy (the trainer's model), critic (``ppo.critic``: a separate model, or a second LoRA adapter on the policy's
base), reference (the base with the adapter disabled for a LoRA policy, else a frozen copy), reward (``reward_funcs``:
functions and/or sequence-classification models).

How each role is distributed (docs/ppo.md has the table and the memory per GPU):

- policy: as TRL prepares it (DDP, a DeepSpeed engine, FSDP).
- separate critic: prepared on its own by the same machinery (``ppo.critic_training.DistributedCritic``: a DDP
  replica, a DeepSpeed engine built from the policy's config, so ZeRO-3 partitions its parameters, gradients and
  Adam states like the policy's, or ``fully_shard`` with the policy's FSDP2 options). Why not one module holding policy
  and critic: see that module's docstring.
- shared-base critic: its adapter and value head are parameters of the policy's module, trained by the policy's
  optimizer in a parameter group of their own (critic learning rate), reduced and sharded with the policy.
- reference (full fine-tuning) and reward models: inference-only, prepared as TRL prepares its reference model
  (``prepare_deepspeed`` / ``prepare_fsdp``); the reward models by TRL's GRPO itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback
from transformers.utils import logging

from ..agents.gym_rollout import GymRollout
from ..compat import trl_trainer_state as trl_state
from ..compat.trl_loss_pass import loss_pass_of
from ..grpo.trainer import GRPOTrainer
from ..losses.value_loss import clipped_value_loss
from ..optim.master_weights import FP32MasterAdamW
from ..rollout.batch import RolloutBatch
from ..trainer_part import TrainerPart
from .checkpoint_state import PPOStatePart
from .config import PPOConfig
from .critic import VALUE_HEAD_MODULE, SeparateCritic, SharedBaseCritic
from .critic_training import CriticBackend, DistributedCritic
from .kl_controller import AdaptiveKLController, FixedKLController
from .roles import build_critic, build_critic_optimizer, build_reference, critic_optimizer_options
from .rollout_advantages import PPORolloutValues

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset
    from peft import PeftConfig
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.get_logger(__name__)


class PPOTrainer(GRPOTrainer):
    """Proximal Policy Optimization with a critic, GAE and a KL-penalized reward (see the module docstring)."""

    _tag_names = ["trl", "ppo", "trlx-scale"]
    # The model card's trainer and paper (TRL's card reads these; GRPO's would name GRPO and DeepSeekMath).
    _name = "PPO"
    _paper = {
        "title": "Proximal Policy Optimization Algorithms",
        "id": "1707.06347",
        "citation": """\
@article{schulman2017proximal,
    title        = {{Proximal Policy Optimization Algorithms}},
    author       = {John Schulman and Filip Wolski and Prafulla Dhariwal and Alec Radford and Oleg Klimov},
    year         = 2017,
    eprint       = {arXiv:1707.06347}
}""",
    }

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Any | list[Any] | None = None,
        args: PPOConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        reward_processing_classes: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        peft_config: PeftConfig | None = None,
        value_model: PreTrainedModel | None = None,
        ref_model: PreTrainedModel | None = None,
        tools: list[Callable] | None = None,
        rollout_func: Any | None = None,
        environment_factory: Any | None = None,
    ):
        if args is None or not isinstance(args, PPOConfig):
            raise ValueError("PPOTrainer needs args=PPOConfig(...) (the critic, GAE and KL fields live there).")
        if reward_funcs is None:
            raise ValueError("PPOTrainer needs reward_funcs: reward functions and/or a sequence-classification model.")
        if args.step_reward_credit == "own_turn" and not isinstance(rollout_func, GymRollout):
            raise ValueError(
                "step_reward_credit='own_turn' places each environment step's reward on its own turn, which needs "
                "rollout_func=GymRollout(...) (its steps' rewards); set step_reward_credit='sequence_end'."
            )
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            # Multi-turn rollouts as GRPOTrainer runs them (agents: tools, TRL environments, GymRollout); their
            # tool results and observations are outside the loss mask, which GAE skips (ppo.advantages).
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        self.kl_controller = (
            AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon)
            if args.adaptive_kl
            else FixedKLController(args.kl_coef)
        )
        self.critic = build_critic(self, value_model)
        self.checkpoint_parts.register("ppo_critic_and_kl", PPOStatePart(self))
        self.ppo_ref_model = build_reference(self, ref_model)
        self.rollout_values = PPORolloutValues(self)
        # The separate critic with its optimizer, wrapped like the policy; None for the shared-base critic, whose
        # parameters the policy's optimizer steps.
        self.critic_training: DistributedCritic | None = None
        if isinstance(self.critic, SeparateCritic):
            self.critic_training = DistributedCritic(
                self.critic,
                build_critic_optimizer(self),
                CriticBackend.for_accelerator(self.accelerator),
                max_grad_norm=args.max_grad_norm,
                gradient_accumulation_steps=args.gradient_accumulation_steps,
                micro_batch_size=args.per_device_train_batch_size,
            )
        elif self._rollout_engine() is not None:
            self._rollout_engine().excluded_parameter_prefixes = (VALUE_HEAD_MODULE + ".",)  # not a weight of vLLM's
        self.add_callback(_StepCriticWithPolicy(self))

    # ------------------------------------------------------------------ the optimizer: the shared-base critic's group

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if not isinstance(self.critic, SharedBaseCritic) or self.optimizer is not None:
            return super().create_optimizer(model)
        # The shared-base critic's adapter and value head are the policy module's parameters: one optimizer, with
        # the critic in a group of its own (its learning rate and Adam options). Hidden while TRL builds the policy's
        # groups, then added.
        critic_params = self.critic.trainable_parameters()
        for param in critic_params:
            param.requires_grad_(False)
        try:
            optimizer = super().create_optimizer(model)
        finally:
            for param in critic_params:
                param.requires_grad_(True)
        group = {"params": critic_params, **critic_optimizer_options(self)}
        if isinstance(optimizer, FP32MasterAdamW):
            optimizer.add_trainable_group(group)
        else:
            optimizer.add_param_group(group)
        return optimizer

    # ------------------------------------------------------------------ rollout: rewards, KL, values, GAE

    def _finish_rollout(self, batch: RolloutBatch) -> RolloutBatch:
        """PPO's advantages replace TRL's group-normalized ones: KL-penalized per-token rewards, the critic's values,
        GAE and whitening (``_values_and_gae``). Evaluation rollouts keep TRL's (no critic step follows them)."""
        if not self.model.training:
            return batch
        return self.rollout_values.values_and_gae(batch)

    def _policy(self):
        return self.accelerator.unwrap_model(self.model)

    # What the memory planner needs to know of this run (trlx_scale.planning.trainer_memory).
    def _planner_algorithm(self) -> str:
        return "ppo"

    def _held_roles(self) -> dict[str, tuple[torch.nn.Module, object]]:
        """The policy, the separate critic (its DeepSpeed engine's optimizer, or its own) and the frozen reference.
        A shared-base critic's adapter and head train in the policy's optimizer: its states are the policy's."""
        roles: dict[str, tuple[torch.nn.Module, object]] = {"policy": (self.model, self.optimizer)}
        if self.critic_training is not None:
            critic = self.critic_training
            optimizer = critic.module.optimizer if critic.backend == "deepspeed" else critic.optimizer
            roles["critic"] = (critic.critic, optimizer)
        if self.ppo_ref_model is not None:
            roles["reference"] = (self.ppo_ref_model, None)
        return roles

    def _planner_extra_roles(self) -> dict:
        return {
            "critic_mode": self.args.critic_mode,
            "critic_lora": self.args.critic_use_peft,
            "reference": self.ppo_ref_model is not None,
        }

    def _rank_balance_algorithm_blocker(self) -> str | None:
        return (
            "PPO's value loss divides by the tokens of each micro-batch step across the ranks, which moving samples "
            "between ranks changes"
        )

    def _defers_old_logprobs(self) -> bool:
        # The rollout needs the old-policy log-probs themselves (the KL-penalized rewards), before any loss pass.
        return False

    # ------------------------------------------------------------------ loss: policy (TRL) + value

    def _compute_loss(self, model, inputs):
        # The loss pass records the policy's log-probs for the approximate KL (compat.trl_loss_pass).
        with loss_pass_of(inputs) as loss_pass:
            policy_loss = super()._compute_loss(model, inputs)
        current_logps = loss_pass.logps
        mode = "train" if self.model.training else "eval"
        if mode == "eval" or "returns" not in inputs:
            return policy_loss
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"].float()
        if "tool_mask" in inputs:  # tool results and observations: no value target, no action (ppo.advantages)
            mask = mask * inputs["tool_mask"].float()
        length = inputs["completion_ids"].size(1)
        values = self.rollout_values.values(input_ids, attention_mask, length)
        value_loss, value_clip = clipped_value_loss(
            values, inputs["old_values"], inputs["returns"], mask, self.args.cliprange_value
        )
        count = mask.sum().clamp(min=1)
        # The value loss is a mean over every rank's tokens (DDP then averages the ranks' gradients), not a mean of
        # the ranks' means: the same on 2 x B/2 rows as on 1 x B.
        global_count = self.rollout_values.sum_across_ranks(mask.sum()).clamp(min=1)
        to_global = count * self.accelerator.num_processes / global_count  # local mean -> share of the global one
        value_loss_for_gradient = value_loss * to_global
        approx_kl = 0.5 * (((current_logps - inputs["old_per_token_logps"]) ** 2) * mask).sum() / count
        # Logged (and compared with target_kl) as means over every rank's tokens: the gathered mean of the shares.
        value_loss, value_clip, approx_kl = value_loss_for_gradient, value_clip * to_global, approx_kl * to_global
        for key, value in (("value_loss", value_loss), ("value_clipfrac", value_clip), ("approx_kl", approx_kl)):
            trl_state.metrics(self, mode)[f"ppo/{key}"].append(
                self.accelerator.gather(value.detach().reshape(1)).mean().item()
            )
        target = self.args.target_kl
        stop = target is not None and self.accelerator.gather(approx_kl.detach().reshape(1)).mean() > 1.5 * target
        if stop:
            # This mini-batch still counts; the rest of the rollout's epochs are skipped: TRL regenerates when its
            # buffer is empty.
            trl_state.drop_buffered_rollout(self)
        trl_state.metrics(self, mode)["ppo/early_stopped"].append(float(stop))
        scale = self.current_gradient_accumulation_steps
        critic_loss = self.args.vf_coef * value_loss_for_gradient / scale
        if self.critic_training is None:  # shared base: one graph, one backward, one optimizer
            return policy_loss + critic_loss
        # A separate critic's loss has a graph of its own: its backward runs through its own wrapper now (DDP or a
        # DeepSpeed engine); the returned loss carries it for logging only.
        self.critic_training.backward(critic_loss)
        return policy_loss + critic_loss.detach()

    def _extra_gradients_finite(self) -> torch.Tensor | bool:
        # A separate critic's gradients count for the non-finite guard: policy and critic steps are skipped together
        # (one PPO loss produced both). The shared-base critic's are in the policy's gradient norm already.
        if self.critic_training is None:
            return True
        return self.critic_training.gradients_finite()

    def _on_skipped_step(self) -> None:
        if self.critic_training is not None:
            self.critic_training.zero_grad()

    def _step_critic(self) -> None:
        if self.critic_training is None:
            return  # shared base: the policy's optimizer stepped the critic's group
        if self.nonfinite_guard.skip:
            return  # the guard skipped this step: the critic's gradients were dropped with the policy's
        with self.phase_timer.phase("critic"):
            self.critic_training.step()

    # ------------------------------------------------------------------ checkpoints: a shared-base policy adapter

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not isinstance(self.critic, SharedBaseCritic):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # PEFT saves the "critic" adapter to a subfolder, and transformers then loads the subfolders only: the
        # policy adapter (the checkpoint's root files) would not be restored. Loaded here; the critic adapter comes
        # from PPO_STATE_NAME (its checkpoint part, PPOStatePart).
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = os.path.join(resume_from_checkpoint, "adapter_model.safetensors")
        result = set_peft_model_state_dict(self._policy(), load_file(path), adapter_name=self.critic.policy_adapter)
        if result.unexpected_keys:
            raise ValueError(f"{path} holds tensors this policy lacks: {result.unexpected_keys[:3]}")
        self._weights_replaced()  # this branch replaces transformers' load, and the policy version feature's hook


class _StepCriticWithPolicy(TrainerPart, TrainerCallback):
    """Steps the critic's optimizer right after each policy optimizer step (same gradient accumulation). Holds the
    trainer weakly (no trainer <-> callback cycle: see profiling's _StepClock)."""

    def __init__(self, trainer: PPOTrainer):
        super().__init__(trainer)

    def on_optimizer_step(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer is not None:
            trainer._step_critic()
