"""What ``AsyncGRPOTrainer``'s producer thread calls back into the trainer for: each group's prompt (tokenized on the
trainer's thread before its version is published: the tokenizer is not thread-safe), its sampling seed (the
colocated engine's, so ``max_staleness=0`` samples what ``GRPOTrainer`` samples), and its rewards (TRL's
reward-function arguments, with a snapshot of the trainer state taken at admission).
"""

from __future__ import annotations

import copy
from typing import Any

from trl.data_utils import is_conversational

from ..compat import trl_trainer_state as trl_state
from ..generation.rollout_seeds import RolloutSeedContext, request_seed
from ..rollout.async_producer import GroupRequest, SampledGroup
from ..rollout.reward_logs import REWARD_LOG_KEY, GroupRewardLog
from ..trainer_part import TrainerPart


class ProducerFeed(TrainerPart):
    """Part of ``AsyncGRPOTrainer``: prompts, seeds and rewards for the producer, and the rollout's number."""

    def prefetch_prompts(self, version: int) -> None:
        """On the trainer's thread, before ``version`` is published: the rows and token ids of every group that
        version admits (the producer's thread never tokenizes: the tokenizer is not thread-safe)."""
        entries = {}
        while self.trainer._schedule.sampled_at(self.trainer._next_prefetch) <= version:
            row = self.trainer._prompt_stream.group(self.trainer._next_prefetch)
            entries[self.trainer._next_prefetch] = {
                "row": row,
                "prompt_ids": self.group_prompt_ids(row),
                # What TRL passes reward functions as `trainer_state`, fixed when the group is admitted: the producer
                # scores while the trainer's own state moves on.
                "trainer_state": copy.copy(self.trainer.state),
            }
            if self.trainer.dynamic_sampling is not None:  # the prompts of the group's replacements, if it needs any
                entries[self.trainer._next_prefetch]["replacements"] = self.trainer.dynamic_sampling.replacements(
                    self.trainer._next_prefetch, self.group_prompt_ids
                )
            self.trainer._next_prefetch += 1
        with self.trainer._prompt_lock:
            self.trainer._prompt_cache.update(entries)

    def group_prompt_ids(self, row: dict[str, Any]) -> list[int]:
        """A row's prompt as TRL tokenizes it. With environments TRL renders each prompt with the tools of its row's
        environment, which it reads from the batch being trained (``_batch_environments``, set by its rollout): this
        row is not part of that batch, so its own environment stands in for the call."""
        if self.trainer.environment_factories is None:
            return list(self.trainer._tokenize_prompts([row["prompt"]])[0][0])
        batch = trl_state.batch_environments(self.trainer)
        trl_state.set_batch_environments(
            self.trainer, [row.get("environment") if trl_state.multi_environment(self.trainer) else None]
        )
        try:
            return list(self.trainer._tokenize_prompts([row["prompt"]])[0][0])
        finally:
            trl_state.set_batch_environments(self.trainer, batch)

    def producer_prompt(self, index: int) -> dict[str, Any]:
        with self.trainer._prompt_lock:
            return self.trainer._prompt_cache.pop(index)

    def group_seed(self, index: int, version: int, prompt: dict[str, Any]) -> int:
        """The colocated engine's seed for this group's request: the run's seed, the step that trains it, the
        group's first row in the step's global batch and its prompt (``rollout_seeds``)."""
        groups = self.trainer._prompt_stream.groups_per_rollout
        rows = self.trainer._prompt_stream.rows_per_rollout
        rank = self.trainer.accelerator.process_index
        step = (
            self.trainer._schedule.trained_at(index) * self.trainer.args.optimizer_steps_per_rollout
        )  # the step it is sampled at
        context = RolloutSeedContext(self.trainer.args.seed, rank, step, "train")
        return request_seed(
            context, prompt["prompt_ids"], rank * rows + (index % groups) * self.trainer.num_generations
        )

    def current_rollout(self) -> int:
        """The rollout about to be trained, which numbers the weights the servers get and the staleness schedule,
        with the trainer's policy version of those weights recorded for the rows they sample."""
        rollout, into = divmod(self.trainer.state.global_step, self.trainer.args.optimizer_steps_per_rollout)
        if into:
            raise RuntimeError(
                f"step {self.trainer.state.global_step} is inside rollout {rollout} ({self.trainer.args.optimizer_steps_per_rollout} "
                "optimizer steps each): no weights of it can be on the servers. Evaluate at rollout boundaries "
                "(eval_steps a multiple of the optimizer steps per rollout)."
            )
        self.trainer._rollout_policy_versions.record(rollout, self.trainer.policy_version)
        return rollout

    async def score_group(self, request: GroupRequest, sampled: SampledGroup) -> list[list[float]]:
        self.trainer._rollout_policy_versions.tag(sampled)
        row = request.prompt["row"]
        size = len(sampled.completion_ids)
        columns = {key: [value] * size for key, value in row.items() if key not in ("prompt", "completion")}
        if self.trainer.tools:  # whole conversations after the prompt (ServerToolLoop)
            completions, environments = self.trainer.server_tools.group_reward_inputs(sampled)
            columns.update(environments)
        else:
            texts = self.trainer.producer_tokenizer.batch_decode(sampled.completion_ids, skip_special_tokens=True)
            if is_conversational({"prompt": row["prompt"]}):
                completions = [[{"role": "assistant", "content": text}] for text in texts]
            else:
                completions = texts
        if (
            self.trainer.server_gym.uses_gym_rollout()
        ):  # the episodes' extra fields (ServerGymRollout), as TRL merges them
            columns.update(self.trainer.server_gym.group_reward_inputs(sampled))
        log = GroupRewardLog(size)  # replayed at the step that trains the group (rollout/reward_logs.py)
        sampled.extras[REWARD_LOG_KEY] = log
        try:
            return await self.trainer._reward_scorer.score(
                [row["prompt"]] * size,
                completions,
                sampled.completion_ids,
                trainer_state=request.prompt["trainer_state"],
                log_metric=log.log_metric,
                log_extra=log.log_extra,
                **columns,
            )
        finally:
            if self.trainer.tools:
                self.trainer.server_tools.group_scored(sampled)
