"""``PPOTrainer``'s advantages: KL-penalized per-token rewards, the critic's values (on padded or packed rows), GAE
and whitening over every rank's tokens (``ppo.advantages``), with the ``ppo/*`` rollout metrics.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.utils import logging

from ..agents.gym_rollout import TURN_REWARDS
from ..compat import trl_trainer_state as trl_state
from ..passes.forward_recompute import recomputes, run_forward
from ..passes.packed_rows import PackedRows, forward_token_limit
from ..passes.packing_support import packing_unsupported_reason
from ..rollout.batch import RolloutBatch
from ..trainer_part import TrainerPart
from .advantages import (
    gae,
    kl_penalty_rewards,
    masked_whiten,
    per_token_kl,
    place_turn_rewards,
    turn_discounts,
)
from .critic import SeparateCritic

logger = logging.get_logger(__name__)


class PPORolloutValues(TrainerPart):
    """``PPOTrainer``'s component (``rollout_values``): values, GAE and the KL controller's update at each rollout,
    and the critic's values for the loss."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        self._critic_packing_decision: bool | None = None

    def values_and_gae(self, batch: RolloutBatch) -> RolloutBatch:
        args, mode = self.trainer.args, "train"
        weights = self.trainer.reward_weights.to(batch.rewards_per_func.device)
        local_rewards = batch.local_rewards_per_func
        turn_column = self._own_turn_reward_column()
        if turn_column is not None:  # step_reward_credit="own_turn": that column's steps go on their turns (below)
            weights = weights.clone()
            turn_weight, weights[turn_column] = weights[turn_column].item(), 0.0
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
                batch.old_per_token_logps = self.trainer._get_per_token_logps_and_entropies(
                    self.trainer.model, input_ids, attention_mask, length, args.per_device_train_batch_size
                )[0]
            with self.trainer.phase_timer.phase("ref_logprobs", absorb=True):  # a LoRA policy's base: the same model
                ref_logps = self._reference_logps(input_ids, attention_mask, length)
            with self.trainer.phase_timer.phase("critic"):
                values = self.values(input_ids, attention_mask, length, args.per_device_train_batch_size)
        kl = per_token_kl(batch.old_per_token_logps, ref_logps, args.kl_estimator) * mask
        rewards = kl_penalty_rewards(scores.to(kl.dtype), kl, self.trainer.kl_controller.value, mask)
        discounts = None
        if turn_column is not None:
            steps = [row.get(TURN_REWARDS) for row in batch.rows]
            step_rewards = place_turn_rewards(steps, mask, turn_weight).to(rewards.dtype)
            rewards = rewards + step_rewards
            scores = scores + step_rewards.sum(dim=1).to(scores.dtype)
            discounts = turn_discounts(mask, self.trainer.rollout_func.turn_reward_discount)
        advantages, returns = gae(rewards, values, mask, args.gamma, args.lam, discounts)
        raw_advantages = advantages
        if args.whiten_advantages:  # over every rank's tokens: the same on 2 x B/2 rows as on 1 x B
            advantages = masked_whiten(advantages, mask, sum_across_ranks=self.sum_across_ranks)
        batch.advantages, batch.returns, batch.old_values = advantages, returns, values

        # Controller update on the mean per-sequence KL of every process's rollouts.
        sequence_kl = self.trainer.accelerator.gather(kl.sum(dim=1))
        kl_coef = self.trainer.kl_controller.value
        self.trainer.kl_controller.update(sequence_kl.mean().item(), sequence_kl.numel())
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
        # One gather for all of them, on the accelerator's device: NCCL gathers only device tensors, and the
        # controller's coefficient is a host float.
        local = torch.stack(
            [value.float().reshape(()).to(self.trainer.accelerator.device) for value in metrics.values()]
        )
        means = self.trainer.accelerator.gather(local.unsqueeze(0)).reshape(-1, len(metrics)).mean(dim=0).tolist()
        for key, mean in zip(metrics, means, strict=True):
            trl_state.metrics(self.trainer, mode)[key].append(mean)
        return batch

    def _own_turn_reward_column(self) -> int | None:
        """The reward column of a GymRollout's discounted step rewards when each step's reward goes on its own turn
        (``step_reward_credit="own_turn"``), else None."""
        if self.trainer.args.step_reward_credit != "own_turn":
            return None
        return self.trainer.reward_func_names.index(f"{self.trainer.rollout_func.name}_turns")

    def _reference_logps(self, input_ids, attention_mask, length) -> torch.Tensor:
        batch_size = self.trainer.args.per_device_train_batch_size
        if self.trainer.ppo_ref_model is not None:
            return self.trainer._get_per_token_logps_and_entropies(
                self.trainer.ppo_ref_model, input_ids, attention_mask, length, batch_size
            )[0]
        with self.trainer._policy().disable_adapter():  # every adapter off: the base model
            return self.trainer._get_per_token_logps_and_entropies(
                self.trainer.model, input_ids, attention_mask, length, batch_size
            )[0]

    def values(self, input_ids, attention_mask, length, chunk_size: int | None = None) -> torch.Tensor:
        """V before each completion token: the value at the position that precedes it. ``chunk_size`` rows at a time
        (the rollout's no-grad pass, like TRL's log-prob pass) so activations stay a micro-batch's. With
        ``padding_free`` the critic runs on the policy passes' packed rows (``passes.packed_rows``)."""
        critic = self.trainer.critic_training if self.trainer.critic_training is not None else self.trainer.critic
        if self.trainer.pass_layout.padding_free_enabled(self.trainer.model) and self._critic_packable():
            return self._packed_values(critic, input_ids, attention_mask, length, chunk_size)
        chunk_size = chunk_size or input_ids.size(0)
        chunks = [
            critic.values(input_ids[start : start + chunk_size], attention_mask[start : start + chunk_size])
            for start in range(0, input_ids.size(0), chunk_size)
        ]
        return torch.cat(chunks)[:, -length - 1 : -1]

    def _packed_values(self, critic, input_ids, attention_mask, length, chunk_size: int | None) -> torch.Tensor:
        max_tokens = self.trainer.args.max_tokens_per_microbatch
        # One forward with gradients under ZeRO-3 with reentrant checkpointing, as for the policy (passes.packed).
        one_forward = torch.is_grad_enabled() and self.trainer.pass_layout.zero3_reentrant_checkpointing(
            self.trainer.model
        )
        forward_tokens = forward_token_limit(chunk_size, input_ids.size(1), max_tokens, one_forward)
        rows = PackedRows.build(
            input_ids,
            attention_mask,
            length,
            max_tokens=max_tokens,
            forward_tokens=forward_tokens,
            coefficient=self.trainer.pass_layout.attention_cost_coefficient(),
        )
        # Sharded critics: as many forwards as the rank with the most (see passes.packed), the extra ones times zero;
        # agreed first, so the ranks agree on recomputing them in the backward too (recompute_forwards).
        forwards = self.trainer.pass_layout.agree_max(len(rows.forwards))
        recompute = recomputes(self.trainer.pass_layout.recompute_forwards(), forwards)

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

    def _critic_packable(self) -> bool:
        """The critic's own model passes the static packing gate (its backbone can differ from the policy's)."""
        if self._critic_packing_decision is None:
            model = (
                self.trainer.critic.model
                if isinstance(self.trainer.critic, SeparateCritic)
                else self.trainer.critic.peft_model
            )
            reason = packing_unsupported_reason(model, self.trainer.accelerator.device.type)
            if reason is not None:
                logger.warning("padding_free: the critic runs on padded rows: %s.", reason)
            self._critic_packing_decision = reason is None
        return self._critic_packing_decision

    def sum_across_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce SUM of a statistic (one collective; the identity on one process)."""
        if self.trainer.accelerator.num_processes == 1:
            return tensor
        return self.trainer.accelerator.reduce(tensor.detach().clone(), reduction="sum")


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over the masked tokens (1: perfect critic, <= 0: useless)."""
    count = mask.sum().clamp(min=2)

    def variance(x):
        mean = (x * mask).sum() / count
        return (((x - mean) * mask) ** 2).sum() / (count - 1)

    return 1 - variance(returns - values) / variance(returns).clamp(min=1e-8)
