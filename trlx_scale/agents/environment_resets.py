"""``rollout_prompts``: a rollout's prompts, with ``environment_factory``'s environments drawn and reset.

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
from ..reliability.rank_agreement import raise_if_any_rank_failed

logger = logging.get_logger(__name__)


def rollout_prompts(trainer: Any, rows: list[dict[str, Any]]) -> list:
    """The rows' prompts, each followed by its environment's observation where a reset returned one (the rollout
    collector's prompt stage of ``GRPOTrainer``: its ``_rollout_prompts``)."""
    if trainer.environment_factories is None:
        if trainer.tools:  # TRL's driver reads each rollout's tools from these lists
            trl_state.set_tool_dicts(trainer, environments.tool_dicts(trainer, len(rows)))
        return [row["prompt"] for row in rows]
    prompts = [row["prompt"] if "prompt" in row else environments.empty_prompt() for row in rows]
    if not environments.supported():
        logger.warning_once(
            f"TRL {environments.trl.__version__} is not one trlx_scale checked its environment pool and tool dicts "
            f"against ({', '.join(environments.TESTED_TRL)})."
        )
    observations, error = None, None
    try:
        trl_state.set_batch_environments(trainer, environments.environment_names(trainer, rows))
        trainer.environments = environments.draw_like_trl(trainer, rows)
        if trainer.tools:
            trl_state.set_tool_dicts(trainer, environments.tool_dicts(trainer, len(rows)))
        if trainer._resets_trl_environments():
            observations = reset_environments(trainer, rows)
    except Exception as failure:  # noqa: BLE001 - raised on every rank just below
        error = failure
    raise_if_any_rank_failed(trainer.accelerator, "resetting the environments", error)
    if observations is None:
        return prompts
    return [environments.with_observation(p, o) for p, o in zip(prompts, observations, strict=True)]


def reset_environments(trainer: Any, rows: list[dict[str, Any]]) -> list:
    """Each row's environment reset with the row: all at once, each under ``tool_timeout`` (``tool_scheduling=
    "concurrent"``), or one after another on the trainer's thread, as TRL does (``"lockstep"``)."""
    arguments = [environments.reset_arguments(row, trl_state.multi_environment(trainer)) for row in rows]
    if trainer.args.tool_scheduling == "concurrent":
        return environments.run_resets(trainer.environments, arguments, trainer.args.tool_timeout)
    return [env.reset(**kwargs) for env, kwargs in zip(trainer.environments, arguments, strict=True)]
