"""``AsyncDynamicSampling``: DAPO's dynamic sampling in ``AsyncGRPOTrainer``, in the producer, off the training loop.

``GRPOTrainer`` fills a step with informative groups by over-sampling, carrying surplus groups over and, last,
another round (``grpo.dynamic_sampling``), because its engine samples a step's groups together and then waits. The
asynchronous producer samples and scores each group on its own, ahead of the trainer: there the replacement is
per group, as soon as it is scored (``rollout.group_replacement``), with no round boundary to wait for and no
surplus to carry. In numbered steps:

1. The producer keeps each scored group whose weighted-reward spread is above ``dynamic_sampling_min_std``
   (``rollout.group_signal``, the rule ``GRPOTrainer`` uses). A group without signal is dropped and its slot sampled
   again with a replacement prompt, at most ``dynamic_sampling_max_rounds`` groups per slot in all; a slot that runs
   out trains on its last group (advantage 0) and the step says so (``batch/filled_frac`` < 1). The dropped groups
   do not move the staleness schedule: a replacement is sampled by the version of the slot it fills.
2. A slot's replacement prompts are rows of the training set read by position from a seeded stream of the rank's own
   (``rollout.refill_prompts``): attempt ``a`` of group ``k`` reads position ``k * (max_rounds - 1) + a - 1``. They
   are tokenized with the slot's first prompt on the trainer's thread (``ProducerFeed.prefetch_prompts``), so the
   producer's thread never tokenizes; the request seeds are the slot's, mixed with the attempt.
3. At a rollout, the trainer waits for its groups (``ServerGeneration.upcoming_groups``) and trains on the rows of
   the prompts they were sampled from, not the data loader's, through the same collector as without dynamic sampling
   (TRL's loss on that batch). Every rank fills its own slots, so every rank trains the same number of samples per
   step, as ZeRO-3 and FSDP need.
4. A checkpoint's rollout window saves each slot's attempts; a resumed run reads the row of a saved group from them,
   and samples every later slot as the uninterrupted run did (steps 1 and 2 depend on the slot alone).

Metrics per step, over every rank's groups: ``batch/zero_variance_frac`` (of all groups sampled, dropped ones
included), ``batch/filled_frac``, ``batch/generation_rounds`` (the most groups one slot sampled),
``batch/oversampling_factor`` (groups sampled per group trained), ``batch/carried_groups`` (0: nothing is carried
over here) and ``batch/dropped_tokens`` (the prompt and completion tokens of the dropped groups: generated, never
trained, so not in TRL's ``num_tokens``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..agents.server_tool_sampler import TOOL_MASKS
from ..compat import trl_trainer_state as trl_state
from ..grpo.dynamic_sampling import check_dynamic_sampling_rollouts
from ..rollout.async_producer import SampledGroup, ScoredGroup
from ..rollout.batch import RolloutBatch
from ..rollout.collector import RolloutCollector
from ..rollout.group_replacement import GroupReplacement
from ..rollout.group_signal import informative_groups
from ..rollout.refill_prompts import RefillPrompts
from ..trainer_part import TrainerPart


class AsyncDynamicSampling(TrainerPart):
    """``AsyncGRPOTrainer.dynamic_sampling`` (built when the field is on): see the module docstring."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        check_dynamic_sampling_rollouts(trainer)
        self.max_attempts = trainer.args.dynamic_sampling_max_rounds
        self.refill = RefillPrompts(
            trainer.train_dataset,
            seed=trainer.args.seed,
            rank=trainer.accelerator.process_index,
            world_size=trainer.accelerator.num_processes,
            num_generations=trainer.num_generations,
        )
        # Read on the producer's thread: a copy of its own, on the CPU where the producer's rewards are.
        self.reward_weights = trainer.reward_weights.detach().to("cpu", torch.float32).clone()
        self.min_std = trainer.args.dynamic_sampling_min_std

    # ---------------------------------------------------------------- the producer's side
    def replacement(self) -> GroupReplacement:
        """What the producer replaces groups with (``rollout.group_replacement``)."""
        return GroupReplacement(
            keeps=self.keeps,
            prompt_for=self.replacement_prompt,
            max_attempts=self.max_attempts,
            token_count=self.token_count,
        )

    @staticmethod
    def token_count(sampled: SampledGroup) -> int:
        """A group's tokens as TRL's ``num_tokens`` counts a generation call's: each completion's prompt and sampled
        tokens (a tool trajectory's tool results left out, as its tool mask says)."""
        prompt = len(sampled.prompt_ids or [])
        masks = sampled.extras.get(TOOL_MASKS)
        if masks is not None:
            return sum(prompt + sum(mask) for mask in masks)
        return sum(prompt + len(ids) for ids in sampled.completion_ids)

    def keeps(self, rewards: list[list[float]]) -> bool:
        """Whether a scored group (its rewards per completion and function, NaN for None) carries signal."""
        table = torch.tensor(rewards, dtype=torch.float32)
        return bool(informative_groups(table, self.reward_weights, table.size(0), self.min_std)[0])

    @staticmethod
    def replacement_prompt(first: dict[str, Any], attempt: int) -> dict[str, Any]:
        """The producer's prompt of a slot's attempt ``attempt`` (>= 1), prefetched with the slot's first one."""
        return {**first["replacements"][attempt - 1], "trainer_state": first["trainer_state"]}

    # ---------------------------------------------------------------- the trainer's thread
    def slot_row(self, index: int, attempt: int) -> dict[str, Any]:
        """The dataset row that attempt ``attempt`` of the rank's group ``index`` samples."""
        if attempt == 0:
            return self.trainer._prompt_stream.group(index)
        return self.refill.row_at(index * (self.max_attempts - 1) + attempt - 1)

    def replacements(self, index: int, tokenize) -> list[dict[str, Any]]:
        """The rows and prompt ids of group ``index``'s later attempts (``tokenize``: a row's prompt ids)."""
        entries = []
        for attempt in range(1, self.max_attempts):
            row = self.slot_row(index, attempt)
            entries.append({"row": row, "prompt_ids": tokenize(row)})
        return entries

    def collect(self, rows: list[dict[str, Any]], version: int) -> RolloutBatch:
        """The rollout of the slots the data loader's ``rows`` stand for: the producer's kept groups, each with the
        row of the prompt it was sampled from."""
        trainer = self.trainer
        size = trainer.num_generations
        with trainer.phase_timer.phase("generation"):  # the wait for the producer's groups, as take_groups' is
            groups = trainer.vllm_generation.upcoming_groups(len(rows) // size)
        self._log(groups)
        trained = [dict(self.slot_row(group.index, group.attempts - 1)) for group in groups for _ in range(size)]
        return RolloutCollector(trainer).collect(trained, version)

    def _log(self, groups: list[ScoredGroup]) -> None:
        trainer = self.trainer
        attempts = [group.attempts for group in groups]
        dropped = sum(attempts) - len(groups) + sum(not group.informative for group in groups)
        informative = sum(group.informative for group in groups)
        dropped_tokens = sum(group.dropped_tokens for group in groups)
        local = torch.tensor(
            [[sum(attempts), dropped, informative, len(groups), dropped_tokens, max(attempts)]],
            dtype=torch.float64,
            device=trainer.accelerator.device,
        )
        every = trainer.accelerator.gather(local).view(-1, 6)
        sampled, zero_variance, informative, slots, dropped_tokens = every[:, :5].sum(dim=0).tolist()
        metrics = trl_state.metrics(trainer, "train")
        metrics["batch/zero_variance_frac"].append(zero_variance / sampled)
        metrics["batch/filled_frac"].append(informative / slots)
        metrics["batch/generation_rounds"].append(every[:, 5].max().item())
        metrics["batch/dropped_tokens"].append(dropped_tokens)
        metrics["batch/oversampling_factor"].append(sampled / slots)
        metrics["batch/carried_groups"].append(0.0)
