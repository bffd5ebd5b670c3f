"""``EnvironmentResetMixin``: TRL's ``environment_factory`` environments are reset off the trainer's thread.

TRL 1.16 resets each rollout's environment in a loop on the trainer's thread before the first turn. Under
``tool_scheduling="concurrent"`` (the default; "lockstep" keeps TRL's loop) this mixin runs those resets first, all
at once in threads, each under ``tool_timeout``, and TRL's loop then reads their observations
(``compat.trl_environment_resets``). A reset that raises or outlives the timeout on any rank stops every rank at once
with the error named (``reliability.rank_agreement``), before anyone enters generation. ``AsyncGRPOTrainer`` does not
reset TRL's instances at all (``_resets_trl_environments``): its producer resets environments of its own for each
group it samples.
"""

from __future__ import annotations

from transformers.utils import logging

from ..compat import trl_environment_resets
from ..options import option
from ..reliability.rank_agreement import raise_if_any_rank_failed

logger = logging.get_logger(__name__)


class EnvironmentResetMixin:
    """Part of ``GRPOTrainer`` (see the module docstring)."""

    def _generate_and_score_completions(self, inputs):
        if self.environment_factories is None or option(self.args, "tool_scheduling") != "concurrent":
            # "lockstep" is TRL's loop throughout, its serial resets included (for resets that are not thread-safe).
            return super()._generate_and_score_completions(inputs)
        if not trl_environment_resets.supported():
            if not getattr(self, "_told_serial_resets", False):
                logger.warning(
                    "TRL %s is not one trlx_scale checked its environment resets against (%s): environments are "
                    "reset by TRL's own loop, one after another on the trainer's thread.",
                    trl_environment_resets.trl.__version__,
                    ", ".join(trl_environment_resets.TESTED_TRL),
                )
                self._told_serial_resets = True
            return super()._generate_and_score_completions(inputs)
        prepared, error = None, None
        try:
            prepared = trl_environment_resets.prepare_resets(
                self, inputs, option(self.args, "tool_timeout"), run=self._resets_trl_environments()
            )
        except Exception as failure:  # noqa: BLE001 - raised on every rank just below
            error = failure
        raise_if_any_rank_failed(self.accelerator, "resetting the environments", error)
        with trl_environment_resets.installed(prepared):
            return super()._generate_and_score_completions(inputs)

    def _resets_trl_environments(self) -> bool:
        """Whether TRL's environment instances are reset for this rollout (False: the rollout does not use them)."""
        return True
