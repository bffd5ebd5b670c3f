"""``RankBalanceMixin``: a scored GRPO rollout's samples dealt to the ranks by cost (``balance_ranks``).

The dealing and the exchange are ``rollout.rank_balance``; this decides when they apply (several processes,
padding-free rows, a loss the move leaves unchanged) and logs what they did: ``batch/rank_imbalance_before_balance``
(max over mean of the ranks' packed-row cost as TRL placed the samples) and ``batch/rank_imbalance_after_balance``.
"""

from __future__ import annotations

from typing import Any

from ..auto_switch import resolve_switch
from ..options import option
from ..rollout.rank_balance import (
    balanced_rank_assignment,
    exchange_rows,
    rank_balance_blocker,
    rank_costs,
)

# The deal replaces TRL's placement only if it lowers the costliest rank's cost by more than this fraction: a
# balanced rollout (completions of equal lengths) moves nothing and costs no exchange.
MIN_GAIN = 0.01


class RankBalanceMixin:
    """For ``GRPOTrainer`` (with ``PaddingFreeMixin``): ``_balance_ranks`` on TRL's rollout dict."""

    def _balance_ranks(self, rows: dict[str, Any]) -> dict[str, Any]:
        """This rank's rows after the deal (the rows unchanged where the move does not apply)."""
        world = self.accelerator.num_processes
        if world == 1 or not self.model.training:
            return rows
        if getattr(self, "_rank_balance_decision", None) is None:
            self._rank_balance_decision, self.rank_balance_off_reason = resolve_switch(
                "balance_ranks", option(self.args, "balance_ranks"), lambda: self._rank_balance_blocker(rows)
            )
        if not self._rank_balance_decision:
            return rows
        local = rows["prompt_mask"].sum(dim=1) + rows["completion_mask"].sum(dim=1)
        num_rows = local.numel()
        lengths = self.accelerator.gather(local).tolist()
        coefficient = self._attention_cost_coefficient()
        # A GRPO group moves whole where a rank holds whole groups (TRL's groups are consecutive rows of the global
        # batch): the shared prefix then still forwards its prompt once, and the placement is the same with the
        # shared prefix on or off (so are the runs' metrics, such as the entropy's mean of the ranks' means).
        unit = self.num_generations if num_rows % self.num_generations == 0 else 1
        placed = [list(range(r * num_rows, (r + 1) * num_rows)) for r in range(world)]
        assignment = balanced_rank_assignment(lengths, world, coefficient, unit_size=unit)
        before, after = rank_costs(lengths, placed, coefficient), rank_costs(lengths, assignment, coefficient)
        if max(after) > (1.0 - MIN_GAIN) * max(before):
            assignment, after = placed, before  # TRL's placement is as good: nothing moves, no exchange
        metrics = self._metrics["train"]
        metrics["batch/rank_imbalance_before_balance"].append(_imbalance(before))
        metrics["batch/rank_imbalance_after_balance"].append(_imbalance(after))
        if assignment is placed:
            return rows
        sequence_ratio = str(getattr(self, "vllm_importance_sampling_mode", "")).startswith("sequence")
        unpadded = ("importance_sampling_ratio",) if sequence_ratio else ()
        return exchange_rows(rows, assignment[self.accelerator.process_index], num_rows, self.accelerator, unpadded)

    def _rank_balance_blocker(self, rows: dict[str, Any]) -> str | None:
        reason = self._rank_balance_algorithm_blocker()
        if reason is not None:
            return reason
        if not self._padding_free_enabled(self.model):
            return (
                "padding_free is off: a padded rank costs its widest sample times its rows, which dealing by length "
                "does not balance"
            )
        return rank_balance_blocker(self.loss_type, float(self.args.top_entropy_quantile), rows.keys())

    def _rank_balance_algorithm_blocker(self) -> str | None:
        """Seam: an algorithm whose loss depends on which rank holds a sample refuses the move (PPO)."""
        return None


def _imbalance(costs: list[float]) -> float:
    mean = sum(costs) / len(costs)
    return max(costs) / mean if mean > 0 else 1.0
