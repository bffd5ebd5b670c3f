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
import weakref
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, TrainerCallback
from transformers.utils import logging
from trl.models.utils import prepare_deepspeed, prepare_fsdp
from trl.trainer.utils import add_fused_lm_head

from ..losses.value_loss import clipped_value_loss
from ..optim.master_weights import FP32MasterAdamW
from ..optim.presets import get_preset
from ..options import option
from ..passes.forward_recompute import recomputes, run_forward
from ..passes.packed_rows import PackedRows, forward_token_limit
from ..passes.packing_support import packing_unsupported_reason
from ..peft_models import is_peft_model
from ..ppo.advantages import gae, kl_penalty_rewards, masked_whiten, per_token_kl
from ..ppo.critic import VALUE_HEAD_MODULE, SeparateCritic, SharedBaseCritic, critic_state, load_critic_state
from ..ppo.critic_training import CriticBackend, DistributedCritic
from ..ppo.kl_controller import AdaptiveKLController, FixedKLController
from ..rollout.batch import RolloutBatch
from .grpo_trainer import GRPOTrainer
from .ppo_config import PPOConfig

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
    ):
        if args is None or not isinstance(args, PPOConfig):
            raise ValueError("PPOTrainer needs args=PPOConfig(...) (the critic, GAE and KL fields live there).")
        if reward_funcs is None:
            raise ValueError("PPOTrainer needs reward_funcs: reward functions and/or a sequence-classification model.")
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
        )
        self.kl_controller = (
            AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon)
            if args.adaptive_kl
            else FixedKLController(args.kl_coef)
        )
        self.critic = self._build_critic(value_model)
        self.ppo_ref_model = self._build_reference(ref_model)
        # The separate critic with its optimizer, wrapped like the policy; None for the shared-base critic, whose
        # parameters the policy's optimizer steps.
        self.critic_training: DistributedCritic | None = None
        if isinstance(self.critic, SeparateCritic):
            self.critic_training = DistributedCritic(
                self.critic,
                self._build_critic_optimizer(),
                CriticBackend.for_accelerator(self.accelerator),
                max_grad_norm=args.max_grad_norm,
                gradient_accumulation_steps=args.gradient_accumulation_steps,
                micro_batch_size=args.per_device_train_batch_size,
            )
        elif self._rollout_engine() is not None:
            self._rollout_engine().excluded_parameter_prefixes = (VALUE_HEAD_MODULE + ".",)  # not a weight of vLLM's
        self.add_callback(_StepCriticWithPolicy(self))

    # ------------------------------------------------------------------ roles

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

    def _build_critic(self, value_model):
        args, policy = self.args, self._policy()
        device = self.accelerator.device
        if args.critic_mode == "shared_base":
            if value_model is not None or not is_peft_model(policy):
                raise ValueError(
                    "critic_mode='shared_base' adds a critic adapter to a LoRA policy: pass peft_config (or a "
                    "PeftModel) and no value_model, or use critic_mode='separate'."
                )
            return SharedBaseCritic(policy, policy.peft_config[policy.active_adapter]).to(device)
        if value_model is None:
            source = args.value_model_name_or_path or policy.config._name_or_path
            value_model = AutoModelForCausalLM.from_pretrained(source, dtype=self._critic_dtype())
        if args.critic_use_peft:
            if not is_peft_model(policy):
                raise ValueError("critic_use_peft reuses the policy's LoRA config: give the policy a peft_config.")
            from peft import get_peft_model

            value_model = get_peft_model(value_model, policy.peft_config[policy.active_adapter])
        if args.gradient_checkpointing:  # the critic's activations are a policy-sized cost: same recompute trade
            kwargs = args.gradient_checkpointing_kwargs or {"use_reentrant": False}
            value_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            if args.critic_use_peft:
                value_model.enable_input_require_grads()  # a frozen embedding feeds the checkpointed LoRA layers
        return SeparateCritic(value_model).to(device)

    def _critic_dtype(self) -> torch.dtype:
        """fp32, unless the policy trains bf16 weights with fp32 masters (``fp32_master_weights``): then the critic
        does the same (bf16 compute, ``FP32MasterAdamW``). Under DeepSpeed the engine's precision config rules; under
        FSDP the sharded parameters are the fp32 masters and the mixed-precision policy computes in bf16."""
        if self.is_fsdp_enabled:
            return torch.float32
        if self.args.uses_fp32_master_weights and self._policy().dtype != torch.float32:
            return self._policy().dtype
        return torch.float32

    def _build_reference(self, ref_model):
        """None for a LoRA policy (its base, adapters disabled, is the reference); else a frozen copy."""
        if is_peft_model(self._policy()):
            if ref_model is not None:
                raise ValueError("A LoRA policy's reference is its base (adapter disabled): drop ref_model.")
            return None
        if ref_model is None:
            ref_model = AutoModelForCausalLM.from_pretrained(
                self._policy().config._name_or_path, dtype=self._policy().dtype
            )
        add_fused_lm_head(ref_model, temperature=self.temperature)
        ref_model.requires_grad_(False).eval()
        # Inference-only, prepared as TRL prepares its own reference model: ZeRO-3 partitions it, FSDP shards it.
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(ref_model, self.accelerator)
        if self.is_fsdp_enabled:
            return prepare_fsdp(ref_model, self.accelerator)
        return self.accelerator.prepare_model(ref_model, evaluation_mode=True)

    def _critic_optimizer_options(self) -> dict:
        preset = get_preset("ppo_critic")
        return {
            "lr": self.args.critic_learning_rate or preset.learning_rate,
            "betas": (preset.adam_beta1, preset.adam_beta2),
            "eps": preset.adam_epsilon,
            "weight_decay": preset.weight_decay,
        }

    def _build_critic_optimizer(self) -> torch.optim.Optimizer:
        params = self.critic.trainable_parameters()
        if any(p.dtype != torch.float32 for p in params) and not self.is_deepspeed_enabled:
            return FP32MasterAdamW(params, **self._critic_optimizer_options())
        return torch.optim.AdamW(params, **self._critic_optimizer_options())

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
        group = {"params": critic_params, **self._critic_optimizer_options()}
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
        return self._values_and_gae(batch)

    def _values_and_gae(self, batch: RolloutBatch) -> RolloutBatch:
        args, mode = self.args, "train"
        weights = self.reward_weights.to(batch.rewards_per_func.device)
        local_rewards = batch.local_rewards_per_func
        scores = (local_rewards * weights).nansum(dim=1)
        # A row no reward function scored (every one returned None / NaN, e.g. reward_errors="skip") has no score:
        # nansum would make it 0 and train towards it. Its completion is masked out of the policy and value losses.
        unscored = torch.isnan(local_rewards).all(dim=1)
        if unscored.any():
            batch.completion_mask = batch.completion_mask * (~unscored).unsqueeze(1).to(batch.completion_mask.dtype)
        input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
        attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
        mask = batch.loss_mask.float()
        length = batch.completion_ids.size(1)
        with torch.no_grad():
            if batch.old_per_token_logps is None:
                batch.old_per_token_logps = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, length, args.per_device_train_batch_size
                )[0]
            with self.phase_timer.phase("ref_logprobs", absorb=True):  # a LoRA policy's base: the same model
                ref_logps = self._reference_logps(input_ids, attention_mask, length)
            with self.phase_timer.phase("critic"):
                values = self._values(input_ids, attention_mask, length, args.per_device_train_batch_size)
        kl = per_token_kl(batch.old_per_token_logps, ref_logps, args.kl_estimator) * mask
        rewards = kl_penalty_rewards(scores.to(kl.dtype), kl, self.kl_controller.value, mask)
        advantages, returns = gae(rewards, values, mask, args.gamma, args.lam)
        raw_advantages = advantages
        if args.whiten_advantages:  # over every rank's tokens: the same on 2 x B/2 rows as on 1 x B
            advantages = masked_whiten(advantages, mask, sum_across_ranks=self._sum_across_ranks)
        batch.advantages, batch.returns, batch.old_values = advantages, returns, values

        # Controller update on the mean per-sequence KL of every process's rollouts.
        sequence_kl = self.accelerator.gather(kl.sum(dim=1))
        kl_coef = self.kl_controller.value
        self.kl_controller.update(sequence_kl.mean().item(), sequence_kl.numel())
        count = mask.sum().clamp(min=1)
        explained = _explained_variance(values, returns, mask)
        metrics = {
            "ppo/score_mean": scores.float().mean(),
            "ppo/kl": sequence_kl.mean(),
            "ppo/kl_coef": torch.tensor(kl_coef),
            "ppo/returns_mean": (returns * mask).sum() / count,
            "ppo/advantages_mean": (raw_advantages * mask).sum() / count,
            "ppo/values_mean": (values * mask).sum() / count,
            "ppo/explained_variance": explained,
            "ppo/unscored_rows": unscored.float().sum(),
        }
        for key, value in metrics.items():
            self._metrics[mode][key].append(self.accelerator.gather(value.float().reshape(1)).mean().item())
        return batch

    def _reference_logps(self, input_ids, attention_mask, length) -> torch.Tensor:
        batch_size = self.args.per_device_train_batch_size
        if self.ppo_ref_model is not None:
            return self._get_per_token_logps_and_entropies(
                self.ppo_ref_model, input_ids, attention_mask, length, batch_size
            )[0]
        with self._policy().disable_adapter():  # every adapter off: the base model
            return self._get_per_token_logps_and_entropies(self.model, input_ids, attention_mask, length, batch_size)[
                0
            ]

    def _values(self, input_ids, attention_mask, length, chunk_size: int | None = None) -> torch.Tensor:
        """V before each completion token: the value at the position that precedes it. ``chunk_size`` rows at a time
        (the rollout's no-grad pass, like TRL's log-prob pass) so activations stay a micro-batch's. With
        ``padding_free`` the critic runs on the policy passes' packed rows (``passes.packed_rows``)."""
        critic = self.critic_training if self.critic_training is not None else self.critic
        if self._padding_free_enabled(self.model) and self._critic_packable():
            return self._packed_values(critic, input_ids, attention_mask, length, chunk_size)
        chunk_size = chunk_size or input_ids.size(0)
        chunks = [
            critic.values(input_ids[start : start + chunk_size], attention_mask[start : start + chunk_size])
            for start in range(0, input_ids.size(0), chunk_size)
        ]
        return torch.cat(chunks)[:, -length - 1 : -1]

    def _packed_values(self, critic, input_ids, attention_mask, length, chunk_size: int | None) -> torch.Tensor:
        max_tokens = option(self.args, "max_tokens_per_microbatch")
        # One forward with gradients under ZeRO-3 with reentrant checkpointing, as for the policy (passes.packed).
        one_forward = torch.is_grad_enabled() and self._zero3_reentrant_checkpointing(self.model)
        forward_tokens = forward_token_limit(chunk_size, input_ids.size(1), max_tokens, one_forward)
        rows = PackedRows.build(
            input_ids,
            attention_mask,
            length,
            max_tokens=max_tokens,
            forward_tokens=forward_tokens,
            coefficient=self._attention_cost_coefficient(),
        )
        # Sharded critics: as many forwards as the rank with the most (see passes.packed), the extra ones times zero;
        # agreed first, so the ranks agree on recomputing them in the backward too (recompute_forwards).
        forwards = self._agree_max(len(rows.forwards))
        recompute = recomputes(self._recompute_forwards(), forwards)

        def critic_forward(ids, positions):
            return critic.values(ids, None, positions)

        outputs = [
            run_forward(critic_forward, f.input_ids, f.position_ids, recompute=recompute) for f in rows.forwards
        ]
        values = rows.position_values(outputs)
        for _ in range(forwards - len(rows.forwards)):
            dummy = input_ids[:1, :2]
            positions = torch.arange(2, device=dummy.device)[None]
            values = values + 0.0 * run_forward(critic_forward, dummy, positions, recompute=recompute).sum()
        return values[:, -length - 1 : -1]

    def _rank_balance_algorithm_blocker(self) -> str | None:
        return (
            "PPO's value loss divides by the tokens of each micro-batch step across the ranks, which moving samples "
            "between ranks changes"
        )

    def _critic_packable(self) -> bool:
        """The critic's own model passes the static packing gate (its backbone can differ from the policy's)."""
        if getattr(self, "_critic_packing_decision", None) is None:
            model = self.critic.model if isinstance(self.critic, SeparateCritic) else self.critic.peft_model
            reason = packing_unsupported_reason(model, self.accelerator.device.type)
            if reason is not None:
                logger.warning("padding_free: the critic runs on padded rows: %s.", reason)
            self._critic_packing_decision = reason is None
        return self._critic_packing_decision

    def _defers_old_logprobs(self) -> bool:
        # The rollout needs the old-policy log-probs themselves (the KL-penalized rewards), before any loss pass.
        return False

    # ------------------------------------------------------------------ loss: policy (TRL) + value

    def _postprocess_loss_logps(self, logps, inputs):
        # The policy's log-probs of this loss pass, for the approximate KL: they ride in the micro-batch itself and
        # are taken out again by _compute_loss, the call this pass runs in.
        inputs[LOSS_PASS_LOGPS_KEY] = logps.detach()
        return super()._postprocess_loss_logps(logps, inputs)

    def _compute_loss(self, model, inputs):
        policy_loss = super()._compute_loss(model, inputs)
        current_logps = inputs.pop(LOSS_PASS_LOGPS_KEY)
        mode = "train" if self.model.training else "eval"
        if mode == "eval" or "returns" not in inputs:
            return policy_loss
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"].float()
        length = inputs["completion_ids"].size(1)
        values = self._values(input_ids, attention_mask, length)
        value_loss, value_clip = clipped_value_loss(
            values, inputs["old_values"], inputs["returns"], mask, self.args.cliprange_value
        )
        count = mask.sum().clamp(min=1)
        # The value loss is a mean over every rank's tokens (DDP then averages the ranks' gradients), not a mean of
        # the ranks' means: the same on 2 x B/2 rows as on 1 x B.
        global_count = self._sum_across_ranks(mask.sum()).clamp(min=1)
        to_global = count * self.accelerator.num_processes / global_count  # local mean -> share of the global one
        value_loss_for_gradient = value_loss * to_global
        approx_kl = 0.5 * (((current_logps - inputs["old_per_token_logps"]) ** 2) * mask).sum() / count
        # Logged (and compared with target_kl) as means over every rank's tokens: the gathered mean of the shares.
        value_loss, value_clip, approx_kl = value_loss_for_gradient, value_clip * to_global, approx_kl * to_global
        for key, value in (("value_loss", value_loss), ("value_clipfrac", value_clip), ("approx_kl", approx_kl)):
            self._metrics[mode][f"ppo/{key}"].append(self.accelerator.gather(value.detach().reshape(1)).mean().item())
        target = self.args.target_kl
        stop = target is not None and self.accelerator.gather(approx_kl.detach().reshape(1)).mean() > 1.5 * target
        if stop:
            # This mini-batch still counts; the rest of the rollout's epochs are skipped: TRL regenerates when its
            # buffer is empty.
            self._buffered_inputs = None
        self._metrics[mode]["ppo/early_stopped"].append(float(stop))
        scale = self.current_gradient_accumulation_steps
        critic_loss = self.args.vf_coef * value_loss_for_gradient / scale
        if self.critic_training is None:  # shared base: one graph, one backward, one optimizer
            return policy_loss + critic_loss
        # A separate critic's loss has a graph of its own: its backward runs through its own wrapper now (DDP or a
        # DeepSpeed engine); the returned loss carries it for logging only.
        self.critic_training.backward(critic_loss)
        return policy_loss + critic_loss.detach()

    def _sum_across_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce SUM of a statistic (one collective; the identity on one process)."""
        if self.accelerator.num_processes == 1:
            return tensor
        return self.accelerator.reduce(tensor.detach().clone(), reduction="sum")

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
        if self._guard_state()["skip"]:
            return  # the guard skipped this step: the critic's gradients were dropped with the policy's
        with self.phase_timer.phase("critic"):
            self.critic_training.step()

    # ------------------------------------------------------------------ checkpoints: the critic and the KL controller

    def _save_extra_state(self, checkpoint_dir: str) -> None:
        super()._save_extra_state(checkpoint_dir)
        # Every rank takes part (ZeRO-3 gathers; a DeepSpeed critic writes its own partitions); rank 0 writes the file.
        if self.critic_training is not None:
            state = self.critic_training.save(checkpoint_dir, self.args.should_save)
        else:  # the shared-base critic's optimizer state is in the policy's optimizer, saved by transformers
            state = {"critic": critic_state(self.critic)}
        if self.args.should_save:
            state["kl_coef"] = self.kl_controller.value
            torch.save(state, os.path.join(checkpoint_dir, PPO_STATE_NAME))

    def _load_extra_state(self, checkpoint_dir: str) -> None:
        super()._load_extra_state(checkpoint_dir)
        path = os.path.join(checkpoint_dir, PPO_STATE_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"{checkpoint_dir} has no {PPO_STATE_NAME} (the critic, its optimizer and the KL coefficient): it was "
                "not written by trlx_scale's PPOTrainer, whose runs cannot resume without their critic."
            )
        state = torch.load(path, map_location="cpu", weights_only=True)
        if self.critic_training is not None:
            self.critic_training.load(checkpoint_dir, state)
        else:
            load_critic_state(self.critic, state["critic"])
        self.kl_controller.value = float(state["kl_coef"])

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not isinstance(self.critic, SharedBaseCritic):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # PEFT saves the "critic" adapter to a subfolder, and transformers then loads the subfolders only: the
        # policy adapter (the checkpoint's root files) would not be restored. Loaded here; the critic adapter comes
        # from PPO_STATE_NAME (_load_extra_state).
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = os.path.join(resume_from_checkpoint, "adapter_model.safetensors")
        result = set_peft_model_state_dict(self._policy(), load_file(path), adapter_name=self.critic.policy_adapter)
        if result.unexpected_keys:
            raise ValueError(f"{path} holds tensors this policy lacks: {result.unexpected_keys[:3]}")
        self._weights_replaced()  # this branch replaces transformers' load, and the policy version feature's hook


PPO_STATE_NAME = "ppo_state.pt"
LOSS_PASS_LOGPS_KEY = "loss_pass_per_token_logps"  # set and taken out within one _compute_loss call


class _StepCriticWithPolicy(TrainerCallback):
    """Steps the critic's optimizer right after each policy optimizer step (same gradient accumulation). Holds the
    trainer weakly (no trainer <-> callback cycle: see profiling's _StepClock)."""

    def __init__(self, trainer: PPOTrainer):
        self._trainer = weakref.ref(trainer)

    def on_optimizer_step(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            trainer._step_critic()


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over the masked tokens (1: perfect critic, <= 0: useless)."""
    count = mask.sum().clamp(min=2)

    def variance(x):
        mean = (x * mask).sum() / count
        return (((x - mean) * mask) ** 2).sum() / (count - 1)

    return 1 - variance(returns - values) / variance(returns).clamp(min=1e-8)
