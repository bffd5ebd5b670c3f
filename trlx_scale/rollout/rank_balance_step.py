"""``RankBalance``: a scored GRPO rollout's samples dealt to the ranks by cost (``balance_ranks``).

The dealing and the exchange are ``rollout.rank_balance``; this decides when they apply (several processes,
padding-free rows, a loss the move leaves unchanged: decided once from the settings; and, per rollout, fields that
every rank has and that can move, agreed by the ranks) and logs what they did: ``batch/rank_imbalance_before_balance``
(max over mean of the ranks' packed-row cost as TRL placed the samples) and ``batch/rank_imbalance_after_balance``.
"""

from __future__ import annotations

from typing import Any

from transformers.utils import logging

from ..auto_switch import resolve_switch
from ..compat import trl_trainer_state as trl_state
from ..passes.micro_batch_plan import imbalance
from ..trainer_part import TrainerPart
from .rank_balance import (
    balanced_rank_assignment,
    exchange_rows,
    rank_balance_blocker,
    rank_costs,
    unmovable_rollout_reason,
)

logger = logging.get_logger(__name__)

# The deal replaces TRL's placement only if it lowers the costliest rank's cost by more than this fraction: a
# balanced rollout (completions of equal lengths) moves nothing and costs no exchange.
MIN_GAIN = 0.01


class RankBalance(TrainerPart):
    """``GRPOTrainer``'s component (``rank_balance``): ``balance`` deals TRL's rollout dict to the ranks. Asks the
    trainer's ``pass_layout`` and its seam ``_rank_balance_algorithm_blocker`` (PPO refuses the move)."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        self.decision: bool | None = None  # decided at the first rollout
        self.off_reason: str | None = None
        self._skip_logged = False

    def balance(self, rows: dict[str, Any]) -> dict[str, Any]:
        """This rank's rows after the deal (the rows unchanged where the move does not apply)."""
        world = self.trainer.accelerator.num_processes
        if world == 1 or not self.trainer.model.training:
            return rows
        if self.decision is None:
            # From the run's settings only (the same on every rank; padding_free is agreed by the ranks).
            self.decision, self.off_reason = resolve_switch(
                "balance_ranks", self.trainer.args.balance_ranks, self._rank_balance_blocker
            )
        if not self.decision or not self._rollout_movable_on_every_rank(rows):
            return rows
        local = rows["prompt_mask"].sum(dim=1) + rows["completion_mask"].sum(dim=1)
        num_rows = local.numel()
        lengths = self.trainer.accelerator.gather(local).tolist()
        coefficient = self.trainer.pass_layout.attention_cost_coefficient()
        # A GRPO group moves whole where a rank holds whole groups (TRL's groups are consecutive rows of the global
        # batch): the shared prefix then still forwards its prompt once, and the placement is the same with the
        # shared prefix on or off.
        unit = self.trainer.num_generations if num_rows % self.trainer.num_generations == 0 else 1
        placed = [list(range(r * num_rows, (r + 1) * num_rows)) for r in range(world)]
        assignment = balanced_rank_assignment(lengths, world, coefficient, unit_size=unit)
        before, after = rank_costs(lengths, placed, coefficient), rank_costs(lengths, assignment, coefficient)
        if max(after) > (1.0 - MIN_GAIN) * max(before):
            assignment, after = placed, before  # TRL's placement is as good: nothing moves, no exchange
        metrics = trl_state.metrics(self.trainer, "train")
        metrics["batch/rank_imbalance_before_balance"].append(imbalance(before))
        metrics["batch/rank_imbalance_after_balance"].append(imbalance(after))
        if assignment is placed:
            return rows
        sequence_ratio = str(getattr(self.trainer, "vllm_importance_sampling_mode", "")).startswith("sequence")
        unpadded = ("importance_sampling_ratio",) if sequence_ratio else ()
        return exchange_rows(
            rows, assignment[self.trainer.accelerator.process_index], num_rows, self.trainer.accelerator, unpadded
        )

    def _rollout_movable_on_every_rank(self, rows: dict[str, Any]) -> bool:
        """Every rank's rollout has the same fields and none that cannot move (one all-gather of the field names
        per rollout): a rank's batch can lack a field another has (TRL drops empty image lists per rank), and the
        exchange runs one collective per field."""
        import torch.distributed as dist

        signature = (sorted(rows), unmovable_rollout_reason(rows))
        everyone = [None] * self.trainer.accelerator.num_processes
        dist.all_gather_object(everyone, signature)
        if all(entry == signature for entry in everyone) and signature[1] is None:
            return True
        if not self._skip_logged:
            reason = next((entry[1] for entry in everyone if entry[1]), "the ranks' rollouts hold different fields")
            logger.warning("balance_ranks: a rollout stays where TRL placed it: %s.", reason)
            self._skip_logged = True
        return False

    def _rank_balance_blocker(self) -> str | None:
        reason = self.trainer._rank_balance_algorithm_blocker()
        if reason is not None:
            return reason
        if not self.trainer.pass_layout.padding_free_enabled(self.trainer.model):
            return (
                "padding_free is off: a padded rank costs its widest sample times its rows, which dealing by length "
                "does not balance"
            )
        return rank_balance_blocker(
            self.trainer.loss_type,
            float(self.trainer.args.top_entropy_quantile),
            entropy_bonus=bool(getattr(self.trainer, "_entropy_bonus_enabled", False)),
            router_aux_loss=bool(getattr(self.trainer, "aux_loss_enabled", False)),
            gradient_accumulation_steps=self.trainer.args.gradient_accumulation_steps,
            steps_per_generation=self.trainer.args.steps_per_generation,
        )
