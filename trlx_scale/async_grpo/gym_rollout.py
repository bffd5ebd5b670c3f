"""``ServerGymRollout``: ``AsyncGRPOTrainer(rollout_func=GymRollout(...))``, the episodes sampled by the producer.

The producer runs each group's episodes on the servers ahead of the trainer (``agents.server_gym_sampler``: every
episode at its own pace, its environment off the event loop's thread) and scores them with the reward functions and
the ``GymRollout``'s reward columns, TRL's arguments plus the rollout's extra fields, as ``GRPOTrainer``'s rollout
hands them to TRL. On the trainer's thread, TRL's ``_generate`` calls the ``rollout_func`` as it does in
``GRPOTrainer``; here that call takes the producer's next groups (``ServerGeneration.take_groups``) and returns their
episodes in TRL's ``rollout_func`` shape, so TRL's scoring path, the loss, ``env_mask`` and the metrics run as in the
synchronous trainer. Evaluation with a ``GymRollout`` is refused at construction (as with tools).
"""

from __future__ import annotations

from typing import Any

from ..agents.gym_rollout import GymRollout
from ..agents.server_gym_sampler import GYM_FIELDS, GYM_METRICS, ROLLOUT_KEYS, ServerGymGroupSampler
from ..agents.trajectory_tokens import ObservationRenderer
from ..compat import trl_trainer_state as trl_state
from ..rollout.async_producer import SampledGroup
from ..trainer_part import TrainerPart


class ServerGymRollout(TrainerPart):
    """Part of ``AsyncGRPOTrainer`` (see the module docstring); its parser and budget are the colocated one's (``gym_rollout``)."""

    def uses_gym_rollout(self) -> bool:
        return isinstance(self.trainer.rollout_func, GymRollout)

    def check(self) -> None:
        """At construction: what this trainer cannot do with a ``GymRollout``, refused by name."""
        if not self.uses_gym_rollout():
            return
        if self.trainer.args.eval_strategy != "no":
            raise ValueError(
                "AsyncGRPOTrainer with rollout_func=GymRollout(...) does not evaluate yet: set eval_strategy='no' "
                "(evaluate with GRPOTrainer on the saved model)."
            )

    def group_sampler(self, client: Any, context: int) -> ServerGymGroupSampler:
        """The producer's sampler of whole episodes, on its own tokenizer (tokenizers are not thread-safe)."""
        tokenizer = self.trainer.producer_tokenizer
        return ServerGymGroupSampler(
            client,
            self.trainer.rollout_func,
            renderer=ObservationRenderer(tokenizer, chat_template=self.trainer.chat_template),
            parse=self.trainer.gym_rollout.turn_parser(tokenizer),
            budget=self.trainer.gym_rollout.budget(context),
            tokenizer=tokenizer,
            prefix_mismatch=self.trainer.args.prefix_mismatch,
        )

    def group_reward_inputs(self, sampled: SampledGroup) -> dict[str, list]:
        """A gym group's extra fields, as reward-function arguments (what TRL merges into the rows in ``GRPOTrainer``)."""
        return {key: list(value) for key, value in sampled.extras[GYM_FIELDS].items() if key not in ROLLOUT_KEYS}

    def rollout(self, gym: GymRollout, prompts: list) -> dict[str, list]:
        """TRL's ``rollout_func`` call: the producer's next groups, their episodes in TRL's shape."""
        if not self.trainer.model.training:
            raise RuntimeError("AsyncGRPOTrainer does not evaluate with a GymRollout (refused at construction).")
        engine = self.trainer.vllm_generation
        scored = engine.take_groups(len(prompts) // self.trainer.num_generations)
        groups = [group.sampled for group in scored]
        output: dict[str, list] = {
            # The groups reach the collector's sampling stage through the generation call (take_groups recorded them).
            "completion_ids": [list(ids) for group in groups for ids in group.completion_ids],
            "logprobs": [list(values) for group in groups for values in group.logprobs],
        }
        for key in groups[0].extras[GYM_FIELDS]:
            output[key] = [value for group in groups for value in group.extras[GYM_FIELDS][key]]
        metrics = trl_state.metrics(self.trainer, "train")
        for name in groups[0].extras[GYM_METRICS]:
            values = [group.extras[GYM_METRICS][name] for group in groups]
            metrics[name].append(sum(values) / len(values))
        for name, value in engine.pop_metrics().items():
            metrics[name].append(value)
        return output
