"""Values that ride through TRL's generation driver on the lists it passes along, instead of in trainer attributes.

TRL's ``_generate(prompts)`` is the rollout's generation driver (chat template, response parsing, the tool loop, a
``rollout_func``'s contract), and its signatures carry token ids and text only. Two values of a trlx_scale rollout
must cross it:

- the dataset **rows** of the prompts, which a ``GymRollout``'s environments reset from: TRL hands a
  ``rollout_func`` the prompts alone. They ride on the prompt list (``RolloutPrompts``): ``_generate`` deep-copies the
  list it is given and passes the copy, a ``RolloutPrompts`` with a copy of the rows, to ``rollout_func``;
- the producer's **scored groups** the server engine's completions came from (``AsyncGRPOTrainer``: their rewards,
  policy versions and tool trajectories were computed off the training loop): TRL's ``_generate_single_turn`` and
  ``_generate`` return the engine's completion-id list as they got it. They ride on that list
  (``ServedCompletionIds``).

Both hold for TRL 1.16 (``tests/test_trl_contract.py`` checks them on TRL's own code); a driver that rebuilt the lists
would drop the values, and the readers (``rows_of``, ``groups_of``) then say so instead of guessing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class RolloutPrompts(list):
    """The rollout's prompts (TRL's list), carrying the dataset row of each."""

    def __init__(self, prompts: Iterable, rows: list[dict[str, Any]]):
        super().__init__(prompts)
        if len(self) != len(rows):
            raise ValueError(f"RolloutPrompts: {len(self)} prompts for {len(rows)} rows.")
        self.rows = rows


class ServedCompletionIds(list):
    """A server engine's completion-id rows (TRL's list), carrying the producer's scored groups they are, in order."""

    def __init__(self, completion_ids: Iterable, groups: list):
        super().__init__(completion_ids)
        self.groups = groups


def rows_of(prompts: list) -> list[dict[str, Any]] | None:
    """The dataset rows ``prompts`` carry (None for a plain list: a rollout built outside the collector)."""
    return prompts.rows if isinstance(prompts, RolloutPrompts) else None


def groups_of(completion_ids: list, what: str) -> list:
    """The scored groups ``completion_ids`` carry; ``what``: the call that should have passed them, for the error."""
    if not isinstance(completion_ids, ServedCompletionIds):
        raise RuntimeError(
            f"{what} returned completion ids without the server engine's groups: TRL's generation driver no longer "
            "passes the engine's list through unchanged (trlx_scale.rollout.carried_values; see "
            "tests/test_trl_contract.py). The installed TRL is not the version this trlx_scale supports."
        )
    return completion_ids.groups
