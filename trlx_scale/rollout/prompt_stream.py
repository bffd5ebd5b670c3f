"""The prompts of a rank's future rollouts, in the order TRL's data loader will hand them to the trainer.

The asynchronous producer starts a group up to ``max_staleness`` steps before the trainer reaches it, so it must
know which prompt the trainer will ask for then. TRL decides that with its ``RepeatSampler`` (seeded: each prompt
``num_generations`` times in a row, each generation batch ``steps_per_generation * num_iterations`` times), and
Accelerate deals the sampler's batches to the ranks in turn (batch ``i`` of ``b`` rows to rank ``i mod world``,
``b`` = ``per_device_train_batch_size * steps_per_generation``). ``RankPromptStream`` replays that on a sampler
built the same way (``GRPOTrainer._get_train_sampler``: same seed, same permutations, epoch after epoch) without a
data loader (no collective runs on the producer's behalf): rollout ``t`` of rank ``r`` is the ``t``-th distinct
batch of the rank, cut into groups of ``num_generations`` identical rows.

The trainer checks at every rollout that the data loader's rows are the ones the stream predicted
(``check_rollout``), so a divergence (a custom sampler, a data loader that skips) is an error, never training on
other prompts' completions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


class RankPromptStream:
    """Rank ``rank``'s groups: ``group(k)`` is the dataset row of the rank's ``k``-th group."""

    def __init__(
        self,
        sampler_factory: Callable[[], Iterable[int]],
        dataset: Any,
        *,
        rank: int,
        world_size: int,
        rows_per_rollout: int,
        num_generations: int,
        repeat_count: int,
    ):
        if rows_per_rollout % num_generations:
            raise ValueError(
                f"per_device_train_batch_size * steps_per_generation ({rows_per_rollout}) must be a multiple of "
                f"num_generations ({num_generations}) for asynchronous generation: each rank samples whole groups "
                "(one request per group). Change per_device_train_batch_size or num_generations."
            )
        self.sampler_factory = sampler_factory
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.rows_per_rollout = rows_per_rollout
        self.num_generations = num_generations
        self.repeat_count = repeat_count
        self.groups_per_rollout = rows_per_rollout // num_generations
        self._rollouts: list[list[int]] = []  # dataset indices of each of this rank's rollouts so far
        self._indices = self._index_stream()

    def _index_stream(self):
        while True:  # one pass of the sampler per epoch, as the trainer's data loader re-iterates it
            yielded = False
            for index in self.sampler_factory():
                yielded = True
                yield index
            if not yielded:
                raise ValueError("the training sampler yields nothing: the dataset is smaller than one batch.")

    def _extend_to(self, rollout: int) -> None:
        batch_rows = self.rows_per_rollout
        while len(self._rollouts) <= rollout:
            # One global generation batch (every rank's batch), then its repeats, which the trainer reuses.
            ranks = [[next(self._indices) for _ in range(batch_rows)] for _ in range(self.world_size)]
            for _ in range(self.repeat_count - 1):
                for _ in range(self.world_size * batch_rows):
                    next(self._indices)
            self._rollouts.append(ranks[self.rank])

    def rollout_indices(self, rollout: int) -> list[int]:
        """The dataset indices of this rank's rows in rollout ``rollout`` (each repeated ``num_generations``
        times, as the data loader yields them)."""
        self._extend_to(rollout)
        return self._rollouts[rollout]

    def group(self, index: int) -> dict[str, Any]:
        """The dataset row of the rank's group ``index``."""
        rollout, position = divmod(index, self.groups_per_rollout)
        indices = self.rollout_indices(rollout)
        rows = indices[position * self.num_generations : (position + 1) * self.num_generations]
        if len(set(rows)) != 1:
            raise ValueError(
                f"group {index} of rank {self.rank} holds several prompts ({sorted(set(rows))}): the sampler does not "
                "repeat each prompt num_generations times in a row. Asynchronous generation needs TRL's sampler."
            )
        return self.dataset[rows[0]]

    def check_rollout(self, rollout: int, rows: list[dict[str, Any]]) -> None:
        """Raise unless ``rows`` (the data loader's) are the prompts this stream predicted for ``rollout``."""
        expected = [self.dataset[i]["prompt"] for i in self.rollout_indices(rollout)]
        got = [row["prompt"] for row in rows]
        if expected != got:
            raise RuntimeError(
                f"rollout {rollout} of rank {self.rank}: the data loader's prompts differ from the ones the "
                "asynchronous producer sampled ahead (a custom sampler, or a data loader that skips batches). "
                "Asynchronous generation needs TRL's own sampler and data order."
            )
