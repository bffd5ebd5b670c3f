"""The policy version: which weights a rollout was sampled with, and whether the engine serves the current ones.

The trainer owns one counter, ``policy_version``: 0 for the weights the run starts from, +1 at every optimizer step
that changed them (a step the non-finite guard skipped did not), saved in each checkpoint and restored on resume. The
engine reports the version it serves (``served_version``); "is the engine current" is one comparison, made in one
place (``RolloutEngine.ensure_version``), and every rollout carries the version that generated it
(``RolloutBatch.policy_version``). This replaces three flags: TRL's ``_last_loaded_step``, DPO's own, and the sync
the engine triggered itself on waking.
"""

from __future__ import annotations

import json
import os
from typing import Any

from transformers import TrainerCallback

from ..atomic_files import write_text_atomically
from ..trainer_part import TrainerPart

POLICY_VERSION_NAME = "policy_version.json"


class PolicyVersion:
    """The trainer's policy version, in one object: the trainer holds it (``trainer.policy``; ``trainer.policy_version``
    reads it), its engines read it (``current``, handed to them as a callable: no reference to the trainer), the
    update counter advances it and the checkpoint part saves and restores it."""

    def __init__(self) -> None:
        self.value = 0

    def current(self) -> int:
        return self.value


class PolicyVersionPart(TrainerPart):
    """The policy version in each checkpoint (``reliability.checkpoint_parts``), the same on every rank: the main
    process writes it."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)

    def save(self, checkpoint_dir: str) -> None:
        trainer = self.trainer
        if trainer.args.should_save:
            path = os.path.join(checkpoint_dir, POLICY_VERSION_NAME)
            write_text_atomically(path, json.dumps({"policy_version": trainer.policy.value}))

    def load(self, checkpoint_dir: str) -> None:
        trainer = self.trainer
        path = os.path.join(checkpoint_dir, POLICY_VERSION_NAME)
        if os.path.isfile(path):
            with open(path) as handle:
                trainer.policy.value = int(json.load(handle)["policy_version"])
        else:  # a checkpoint of an older version: its weights are the step's (what the count would say)
            trainer.policy.value = trainer.state.global_step


class CountPolicyUpdates(TrainerPart, TrainerCallback):
    """+1 after each optimizer step that changed the weights (before the guard's own on_step_end resets its flag)."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)

    def on_optimizer_step(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer is not None and trainer._weights_were_updated():
            trainer.policy.value += 1


class RolloutPolicyVersions:
    """Asynchronous generation: the policy version of the weights published for each rollout.

    The staleness schedule counts rollouts (one per optimizer step: ``max_staleness`` bounds how many rollouts
    behind a sample may be, and the sampling seeds name the rollout), while a sample's ``policy_version`` counts the
    weight updates behind it, as everywhere else: a step the non-finite guard skipped advanced the first and not the
    second. The trainer records, before publishing rollout ``r``'s weights, the policy version they are; the producer
    tags each group with the version of the rollout that sampled it (``tag``, read on its thread after the
    publish, so the entry is there). Written by the trainer's thread only; a dict is safe to read across threads.
    """

    EXTRAS_KEY = "policy_version"  # in SampledGroup.extras, saved with the checkpoint's rollout window
    # Each sampled token's policy version, where a reload can land inside a completion (SampledGroup.token_versions)
    TOKENS_KEY = "token_policy_versions"

    def __init__(self) -> None:
        self._by_rollout: dict[int, int] = {}

    def record(self, rollout: int, policy_version: int) -> None:
        self._by_rollout.setdefault(rollout, policy_version)

    def tag(self, sampled) -> None:
        """Set ``sampled.extras[EXTRAS_KEY]``, the policy version of the rollout that sampled the group."""
        if self.EXTRAS_KEY in sampled.extras:  # restored from a checkpoint's window
            return
        if sampled.version not in self._by_rollout:
            raise RuntimeError(
                f"a group was sampled by rollout {sampled.version}'s weights, which were never published."
            )
        sampled.extras[self.EXTRAS_KEY] = self._by_rollout[sampled.version]
        if sampled.token_versions is not None:  # every version a token names was recorded before it was served
            sampled.extras[self.TOKENS_KEY] = [
                [self._by_rollout[version] for version in versions] for versions in sampled.token_versions
            ]

    @classmethod
    def of(cls, sampled) -> int:
        return int(sampled.extras[cls.EXTRAS_KEY])

    @classmethod
    def of_tokens(cls, sampled) -> list[list[int]]:
        """Each completion's tokens' policy versions (the group's for every token where none were reported)."""
        per_token = sampled.extras.get(cls.TOKENS_KEY)
        if per_token is not None:
            return per_token
        return [[cls.of(sampled)] * len(ids) for ids in sampled.completion_ids]
