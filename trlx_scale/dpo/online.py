"""``OnlineDPO``: ``DPOTrainer(online=True)``: each step the current policy samples, rewards rank, DPO trains.

Each step, the batch's prompts are sampled by the current policy on the colocated engine (LoRA-only sync,
sleep/wake) and ``reward_funcs`` score the completions, both through the rollout collector
(``rollout.collector.RolloutCollector.sample_and_score``, whose stages this component supplies), and DPO trains on each
prompt's (best, worst) pair. Across
ranks the pairs are dealt evenly, tie pairs topping up the short ranks (``dpo.online_pair_balance``), so the
gradient is exactly the mean over the step's real pairs. A checkpoint keeps the round's statistics, so a resumed
run logs and scores as the uninterrupted one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import gather, gather_object
from transformers.utils import logging
from trl.data_utils import is_conversational

from ..compat import trl_trainer_state as trl_state
from ..reliability.reward_guard import raise_reward_errors
from ..rollout.collector import RolloutCollector, RolloutSamples
from ..rollout.reward_scoring import ConcurrentRewardScorer
from ..trainer_part import TrainerPart
from .online_pair_balance import balance_pairs, tie_pair_loss
from .preference_pairs import best_worst_pairs

logger = logging.get_logger(__name__)


class OnlineDPO(TrainerPart):
    """``DPOTrainer``'s online rounds (``online``; see the module docstring): its overrides of TRL's dataset
    preparation and of the training step, and the rollout collector's stages, delegate here."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        self._online_scorer: ConcurrentRewardScorer | None = None  # built at the first online round
        # The step's loss correction for the pairs dealt to the ranks (dpo/online_pair_balance.py), read by the
        # trainer's loss during the step that set them: a scale of the mean, and the tie pairs' constant.
        self.loss_scale, self.loss_offset = 1.0, 0.0

    def close(self) -> None:
        """The scorer's threads live only as long as a run (a later train() starts them again)."""
        if self._online_scorer is not None:
            self._online_scorer.close()

    def prepare_dataset(self, dataset, dataset_name):
        """The prompts tokenized for sampling (TRL's ``_prepare_dataset`` of an online run)."""
        first = next(iter(dataset))
        if "prompt" not in first:
            raise ValueError(
                f"online=True needs a 'prompt' column in the {dataset_name} dataset; it has {list(first)}."
            )
        tokenizer = trl_state.tokenizer(self.trainer)

        def tokenize(example):
            if is_conversational(example):
                ids = tokenizer.apply_chat_template(example["prompt"], add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]
            return {"prompt_ids": list(ids)}

        return dataset.map(tokenize, desc=f"Tokenizing {dataset_name} prompts")

    def training_step(self, base_step: Callable, model, inputs, num_items_in_batch=None):
        """One online step: sample, score and pair the batch's prompts, then DPO's step (``base_step``) on the pairs.
        Inside TrainerFeatures.training_step: profiled and guarded on every path, the batch without pairs included."""
        pairs = self.round(inputs)
        if self.trainer.accelerator.num_processes > 1:
            # Equal numbers of pairs on every rank (TRL's loss gathers per-pair tensors); the loss is rescaled so
            # the gradient stays the mean over the step's real pairs (dpo/online_pair_balance.py).
            balanced = balance_pairs(
                gather_object(pairs), self.trainer.accelerator.process_index, self.trainer.accelerator.num_processes
            )
            pairs, self.loss_scale = balanced.pairs, balanced.loss_scale
            world = self.trainer.accelerator.num_processes
            tie = tie_pair_loss(list(self.trainer.loss_types), self.trainer.loss_weights, self.trainer.beta)
            self.loss_offset = world * balanced.padding * tie / max(balanced.total, 1)
            trl_state.metrics(self.trainer, "train")["online/padding_pairs"].append(float(balanced.total_padding))
        if not pairs:
            # Every prompt's samples scored the same: no preference to learn. A zero loss still runs backward, so
            # data-parallel ranks stay in step.
            model.train()
            loss = sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
            self.trainer.accelerator.backward(loss)
            return loss.detach()
        try:
            return base_step(model, self.trainer._pair_collator(pairs), num_items_in_batch)
        finally:
            self.loss_scale, self.loss_offset = 1.0, 0.0

    def global_round_stats(self, stats: dict[str, float], pairs: int) -> dict[str, float]:
        """The round's statistics over every rank (each rank has as many prompts and samples as the others): means
        of the rank means, and the reward gap averaged over all pairs."""
        if self.trainer.accelerator.num_processes == 1:
            return stats
        local = torch.tensor(
            [stats["reward_mean"], stats["pair_fraction"], stats["reward_gap"] * pairs, float(pairs)],
            device=self.trainer.accelerator.device,
        )
        reward_mean, pair_fraction, gap_sum, total = self.trainer.accelerator.reduce(local, reduction="sum").tolist()
        world = self.trainer.accelerator.num_processes
        return {
            "reward_mean": reward_mean / world,
            "pair_fraction": pair_fraction / world,
            "reward_gap": gap_sum / total if total else 0.0,
        }

    def round(self, examples: list[dict[str, Any]]) -> list[dict[str, list[int]]]:
        """Sample, score and pair one batch of prompts with the current policy: the rollout collector's sampling and
        reward stages (``RolloutCollector.sample_and_score``, through this trainer's ``_rollout_prompts``,
        ``_sample_rollout`` and ``_rollout_rewards``), then each prompt's (best, worst) pair."""
        group = self.trainer.args.online_num_generations
        rows = [dict(example) for example in examples for _ in range(group)]  # each prompt's group together
        scored = RolloutCollector(self.trainer).sample_and_score(rows, self.trainer.policy_version)
        rewards = torch.zeros(len(rows))
        for column in scored.local_rewards_per_func.cpu().T:  # the functions' sum, NaN where one gave None
            rewards += column
        prompt_ids = [example["prompt_ids"] for example in examples]
        completion_ids = scored.samples.completion_ids
        pairs, stats = best_worst_pairs(prompt_ids, completion_ids, rewards.view(len(examples), group))
        stats = self.global_round_stats(stats, len(pairs))
        for key, value in {**stats, **self.trainer._colocated_engine().pop_metrics()}.items():
            trl_state.metrics(self.trainer, "train")[key if "/" in key else f"online/{key}"].append(value)
        return pairs

    # ---------------------------------------------------------------- the collector's stages (through the trainer's)
    def sample(self, prompts: list, rows: list[dict[str, Any]]) -> RolloutSamples:
        """The current policy's completions of ``rows`` (each prompt's group together) on the colocated engine, which
        serves the trainer's policy version (LoRA-only sync where possible), with its log-probs of the sampled
        tokens."""
        engine = self.trainer._colocated_engine()
        prompt_ids = [row["prompt_ids"] for row in rows]
        engine.set_rollout_seed(self.trainer.args.seed, self.trainer.state.global_step)
        with self.trainer.phase_timer.phase("generation"):
            _, completion_ids, logprobs, _ = engine.generate(
                prompts=prompt_ids, images=None, num_generations=self.trainer.args.online_num_generations
            )
        self.trainer.profiler.count_generation(prompt_ids, completion_ids)
        texts = trl_state.tokenizer(self.trainer).batch_decode(completion_ids, skip_special_tokens=True)
        conversational = is_conversational(rows[0])
        return RolloutSamples(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            tool_mask=None,
            completions=[[{"role": "assistant", "content": t}] for t in texts] if conversational else texts,
            sampling_logps=[[token[0] for token in row] for row in logprobs],  # the sampled token's (top-1 slot)
            extra_fields={},
            images=None,
            tool_images=None,
        )

    def rewards(self, rows: list[dict[str, Any]], prompts: list, samples: RolloutSamples) -> torch.Tensor:
        """(B_all, F): GRPO's scorer, with TRL's reward-function arguments (the rows' other columns, a snapshot of
        the trainer state, ``log_metric``; DPO keeps no completions table, so what ``log_extra`` is given is
        dropped), guarded (``reward_errors``); NaN where a function gave None; every process's rows."""
        columns = {key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "prompt_ids")}
        with self.trainer.phase_timer.phase("reward"):
            if self._online_scorer is None:
                self._online_scorer = ConcurrentRewardScorer(
                    self.trainer.reward_funcs,
                    max_workers=len(self.trainer.reward_funcs),
                    sequential=self.trainer.args.reward_scoring == "sequential",
                )
            scores = self._online_scorer.score_now(
                prompts,
                samples.completions,
                samples.completion_ids,
                trainer_state=copy.copy(self.trainer.state),
                log_metric=lambda name, value: trl_state.metrics(self.trainer, "train")[name].append(value),
                log_extra=lambda column, values: None,
                **columns,
            )
            report = raise_reward_errors(self.trainer.reward_funcs, self.trainer.accelerator)
        metrics = trl_state.metrics(self.trainer, "train")
        if report.skipped or self.trainer.args.reward_errors == "skip":
            metrics["reliability/reward_errors"].append(float(report.skipped))
        if report.retries:
            metrics["reliability/reward_retries"].append(float(report.retries))
        return gather(torch.tensor(scores, dtype=torch.float32, device=self.trainer.accelerator.device))


def keep_examples(examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Online DPO's collator: the rows go to the online round as they are."""
    return examples
