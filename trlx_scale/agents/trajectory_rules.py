"""``tool_trajectory_rules``: the rules a trainer's tool-calling trajectories continue under, read from its config once.

One loop (``tool_call_continuation.continue_trajectories``) runs every trajectory of both trainers; what differs is
the sampler of the later turns (``ColocatedTurnSampler`` on the colocated engine, ``ReplicaTurns`` on a server replica)
and the tokenizer (the trainer's, or the asynchronous producer's own copy: tokenizers are not thread-safe). Everything
else (the budget, the tool-message cap, the template prefix check and its policy, the tool timeout, how a turn is
parsed) is built here, from the same fields, for both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trl.chat_template_utils import parse_response

from .tool_call_continuation import ContinuationLimits, TrajectoryRules
from .trajectory_tokens import TurnBudget


def tool_trajectory_rules(
    trainer: Any,
    *,
    tokenizer: Any,
    max_model_len: int,
    suffix_ids: Callable[[list[dict[str, Any]]], list[int]],
) -> TrajectoryRules:
    """The rules of ``trainer``'s trajectories on an engine of context ``max_model_len``, parsed and capped with
    ``tokenizer``; ``suffix_ids`` renders tool messages alone (TRL's ``_get_tool_suffix_ids`` or its producer copy)."""
    args = trainer.args
    limits = ContinuationLimits(
        max_completion_length=trainer.max_completion_length,
        max_model_len=max_model_len,
        max_tool_calling_iterations=trainer.max_tool_calling_iterations,
        max_turn_tokens=args.max_turn_tokens,
    )
    fit = None
    if args.max_tool_response_tokens is not None:
        budget = TurnBudget(
            max_completion_length=limits.max_completion_length,
            max_model_len=limits.max_model_len,
            max_tool_response_tokens=args.max_tool_response_tokens,
            tool_response_overflow=args.tool_response_overflow,
        )

        def fit(message: dict[str, Any]) -> tuple[dict[str, Any], bool]:
            return budget.fit_tool_message(message, tokenizer)

    def parse(ids: list[int], held: list[int], tools: Any) -> dict[str, Any]:
        """A later turn's message, parsed as TRL's loop parses it (``held``: the ids the turn continued)."""
        return parse_response(tokenizer, ids, prefix=held, tools=tools)

    return TrajectoryRules(
        limits=limits,
        parse=parse,
        suffix_ids=suffix_ids,
        fit_tool_message=fit,
        prefix_mismatch_at=template_prefix_check(tokenizer, trainer.chat_template, trainer.chat_template_kwargs),
        prefix_mismatch=args.prefix_mismatch,
        tool_timeout=args.tool_timeout,
    )


def template_prefix_check(processing_class: Any, chat_template: Any, chat_template_kwargs: dict[str, Any]):
    """``prefix_mismatch_at(conversation, held ids, tools)`` on ``processing_class``: where the held ids stop being a
    prefix of the chat template's rendering of the conversation, rendered as TRL renders prompts (its chat template
    and kwargs, the rollout's tools), with the next assistant header; None if they are one."""

    def mismatch_at(conversation: list, held: list[int], tools) -> int | None:
        rendered = processing_class.apply_chat_template(
            conversation,
            tools=tools or None,  # TRL's `or None`
            chat_template=chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **chat_template_kwargs,
        )
        if isinstance(rendered, dict) or hasattr(rendered, "input_ids"):  # a BatchEncoding
            rendered = rendered["input_ids"]
        for position, token in enumerate(held):
            if position >= len(rendered) or rendered[position] != token:
                return position
        return None

    return mismatch_at
