"""``EnvironmentResetMixin``: a rollout's prompts, with ``environment_factory``'s environments drawn and reset.

The first stage of the rollout collector (``rollout.collector``). Each row gets an instance from TRL's pool and the
per-rollout tool functions TRL's generation driver reads (``compat.trl_rollout_environments``). Under
``tool_scheduling="concurrent"`` (the default) every reset runs at once, each in a thread under ``tool_timeout``;
"lockstep" resets them one after another on the trainer's thread, as TRL does (for resets that are not
thread-safe). A reset that raises or outlives the timeout on any rank stops every rank at once with the error named
(``reliability.rank_agreement``), before anyone enters generation. ``AsyncGRPOTrainer`` draws but does not reset
(``_resets_trl_environments``): its producer resets environments of its own for each group it samples.
"""

from __future__ import annotations

from typing import Any

from transformers.utils import logging

from ..compat import trl_rollout_environments as environments
from ..compat import trl_trainer_state as trl_state
from ..options import option
from ..reliability.rank_agreement import raise_if_any_rank_failed

logger = logging.get_logger(__name__)


class EnvironmentResetMixin:
    """Part of ``GRPOTrainer`` (see the module docstring)."""

    def _rollout_prompts(self, rows: list[dict[str, Any]]) -> list:
        """The rows' prompts, each followed by its environment's observation where a reset returned one."""
        if self.environment_factories is None:
            if self.tools:  # TRL's driver reads each rollout's tools from these lists
                trl_state.set_tool_dicts(self, environments.tool_dicts(self, len(rows)))
            return [row["prompt"] for row in rows]
        prompts = [row["prompt"] if "prompt" in row else environments.empty_prompt() for row in rows]
        if not environments.supported() and not getattr(self, "_told_untested_environments", False):
            logger.warning(
                "TRL %s is not one trlx_scale checked its environment pool and tool dicts against (%s).",
                environments.trl.__version__,
                ", ".join(environments.TESTED_TRL),
            )
            self._told_untested_environments = True
        observations, error = None, None
        try:
            trl_state.set_batch_environments(self, environments.environment_names(self, rows))
            self.environments = environments.draw_like_trl(self, rows)
            if self.tools:
                trl_state.set_tool_dicts(self, environments.tool_dicts(self, len(rows)))
            if self._resets_trl_environments():
                observations = self._reset_environments(rows)
        except Exception as failure:  # noqa: BLE001 - raised on every rank just below
            error = failure
        raise_if_any_rank_failed(self.accelerator, "resetting the environments", error)
        if observations is None:
            return prompts
        return [environments.with_observation(p, o) for p, o in zip(prompts, observations, strict=True)]

    def _reset_environments(self, rows: list[dict[str, Any]]) -> list:
        arguments = [environments.reset_arguments(row, trl_state.multi_environment(self)) for row in rows]
        if option(self.args, "tool_scheduling") == "concurrent":
            return environments.run_resets(self.environments, arguments, option(self.args, "tool_timeout"))
        return [env.reset(**kwargs) for env, kwargs in zip(self.environments, arguments, strict=True)]

    def _resets_trl_environments(self) -> bool:
        """Whether TRL's environment instances are reset for this rollout (False: the rollout does not use them)."""
        return True
