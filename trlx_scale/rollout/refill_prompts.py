"""``RefillPrompts``: the prompts a rank draws beyond its data loader's, to replace groups dynamic sampling drops.

The data loader hands each rank its rollout's rows (TRL's ``RepeatSampler``); dynamic sampling needs more prompts in
the same step (over-sampling, another round). They come from a stream of its own over the training set, so TRL's
sampler (and with it which prompts later steps get) is untouched: a seeded permutation per pass over the dataset,
rank ``r`` of ``w`` taking every ``w``-th prompt from position ``r``, each prompt's row repeated ``num_generations``
times (a group). Its position is the only state (checkpointed with the dynamic sampling state, so a resumed run draws
what the uninterrupted one drew). ``AsyncGRPOTrainer`` reads it by position instead (``row_at``): the replacements of
group ``k`` are a function of ``k``, whatever the timing.
"""

from __future__ import annotations

from typing import Any

import torch


class RefillPrompts:
    """Rank ``rank``'s stream of extra groups over ``dataset`` (``draw``); ``position``: groups drawn so far."""

    def __init__(self, dataset: Any, *, seed: int, rank: int, world_size: int, num_generations: int):
        if len(dataset) == 0:
            raise ValueError("dynamic_sampling draws extra prompts from train_dataset, which is empty.")
        self.dataset, self.seed, self.rank, self.world_size = dataset, seed, rank, world_size
        self.num_generations = num_generations
        self.position = 0
        self._order: tuple[int, list[int]] | None = None  # (pass, permutation) of the last pass read

    def _index(self, global_position: int) -> int:
        epoch, offset = divmod(global_position, len(self.dataset))
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(len(self.dataset), generator=generator).tolist())
        return self._order[1][offset]

    def row_at(self, position: int) -> dict[str, Any]:
        """The dataset row of this rank's ``position``-th group of the stream, whatever was drawn before (the
        asynchronous producer reads its replacements by position: a function of the group they replace)."""
        return self.dataset[self._index(position * self.world_size + self.rank)]

    def draw(self, groups: int) -> list[dict[str, Any]]:
        """The rows of the next ``groups`` groups: each prompt's row ``num_generations`` times in a row."""
        rows: list[dict[str, Any]] = []
        for step in range(groups):
            row = self.row_at(self.position + step)
            rows.extend(dict(row) for _ in range(self.num_generations))
        self.position += groups
        return rows
