"""Token-in/token-out: one trajectory's tokens as the engine sampled them, the observations rendered alone, the
template's rendering checked against them each turn, and the budgets that bound the next turn.

Re-tokenizing the conversation each turn (TRL's experimental async trainer, many agent stacks) trains on tokens
the model never sampled whenever decode -> encode is not the identity (a merge across the turn boundary, a
normalised space) or the chat template rewrites history (Qwen3 drops earlier ``<think>`` blocks; GPT-OSS rewrites
its end token). So a trajectory here keeps:

- the prompt's ids, then each turn's sampled ids exactly as sampled (loss mask 1, the end-of-turn token included,
  with the engine's log-probs), then each observation's ids (loss mask 0, log-prob 0), rendered by
  ``ObservationRenderer``: only the new messages plus the next assistant header, as TRL renders its tool suffix;
- a prefix check per turn: the held ids must be a prefix of the template's rendering of the whole conversation.
  A mismatch means a re-tokenizing engine would see other tokens than the ones sampled; the policy
  (``prefix_mismatch``) is ``"keep"`` (train the sampled tokens, count it: what was sampled is what trains) or
  ``"discard"`` (the trajectory is masked out of the loss), each counted in ``agents/prefix_mismatches``.

``TurnBudget``: each turn's ``max_tokens`` is the least of the per-turn limit, what is left of the trajectory's
total (``max_completion_length``: sampled and observation tokens together, as TRL counts it) and what is left of
the model's context; nothing is sampled once it is 0, and a tool response longer than ``max_tool_response_tokens``
is truncated or replaced by a notice (``tool_response_overflow``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

PREFIX_MISMATCH_POLICIES = ("keep", "discard", "off")  # "off": no check
TOOL_RESPONSE_OVERFLOW = ("truncate", "drop")


@dataclasses.dataclass
class TrajectoryTokens:
    """One trajectory's ids after its prompt, with the loss mask and behaviour log-probs aligned to them."""

    prompt_ids: list[int]
    completion_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)  # 1: sampled (trained), 0: observation
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turns: int = 0  # assistant turns sampled
    discarded: bool = False  # the prefix policy dropped it from the loss
    # Each id's weight version, kept while every sampled turn reports its tokens' (full weights reloaded with
    # requests kept in flight); observation ids take the version of the turn before them. None otherwise.
    versions: list[int] | None = None

    def add_sampled(
        self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int] | None = None
    ) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"a sampled turn has {len(ids)} tokens and {len(logprobs)} log-probs.")
        if versions is None or (self.turns and self.versions is None):
            self.versions = None  # a turn without them: the trajectory has none
        else:
            self.versions = (self.versions or []) + list(versions)
        self.completion_ids += list(ids)
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(value) for value in logprobs]
        self.turns += 1

    def add_observation(self, ids: Sequence[int]) -> None:
        if self.versions is not None:
            self.versions += [self.versions[-1] if self.versions else 0] * len(ids)
        self.completion_ids += list(ids)
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    @property
    def context_ids(self) -> list[int]:
        """What the engine is given for the next turn: the prompt and everything after it, as held."""
        return self.prompt_ids + self.completion_ids

    @property
    def trained_mask(self) -> list[int]:
        """The loss mask as the loss sees it: all 0 once the trajectory was discarded."""
        return [0] * len(self.loss_mask) if self.discarded else list(self.loss_mask)


class TemplateError(ValueError):
    """A chat template that cannot render observations alone or keep a trajectory's tokens."""


class ObservationRenderer:
    """Renders conversations with one tokenizer's chat template (or TRL's training template in its place)."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None, tools: list[Any] | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tools = tools or None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may hand back a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def observation_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The ids of ``messages`` (tool results, environment feedback) and the next assistant header, rendered
        after a closed assistant turn and cut off it: the tokens the engine reads between two sampled turns."""
        stem = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]
        before = self.render(stem, add_generation_prompt=False)
        after = self.render(stem + list(messages), add_generation_prompt=True)
        if after[: len(before)] != before:
            raise TemplateError(
                "the chat template renders earlier messages differently once observations follow them (it is not "
                "prefix-preserving), so observations cannot be appended to the sampled tokens. Use TRL's training "
                "template for this model (trl.chat_template_utils.get_training_chat_template) or fix the template."
            )
        return after[len(before) :]

    def first_mismatch(self, conversation: list[dict[str, Any]], held_ids: Sequence[int]) -> int | None:
        """Where the held ids stop being a prefix of the template's rendering of ``conversation`` (with the next
        assistant header), or None if they are one."""
        rendered = self.render(conversation, add_generation_prompt=True)
        for position, token in enumerate(held_ids):
            if position >= len(rendered) or rendered[position] != token:
                return position
        return None


@dataclasses.dataclass(frozen=True)
class TurnBudget:
    """How many tokens the next turn may sample (see the module docstring)."""

    max_completion_length: int  # sampled and observation tokens after the prompt, the whole trajectory
    max_model_len: int  # the engine's context: prompt + everything after it + the next turn
    max_turn_tokens: int | None = None  # per turn; None: only the two bounds above
    max_tool_calling_iterations: int | None = None  # tool rounds; None: unbounded (TRL's None)
    max_tool_response_tokens: int | None = None
    tool_response_overflow: str = "truncate"

    def __post_init__(self) -> None:
        if self.tool_response_overflow not in TOOL_RESPONSE_OVERFLOW:
            raise ValueError(
                f"tool_response_overflow must be one of {TOOL_RESPONSE_OVERFLOW}, got {self.tool_response_overflow!r}."
            )
        for name in ("max_completion_length", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")

    def next_turn_tokens(self, tokens: TrajectoryTokens) -> int:
        """``max_tokens`` for the next turn: 0 when the trajectory's budget or the context is spent."""
        left_total = self.max_completion_length - len(tokens.completion_ids)
        left_context = self.max_model_len - len(tokens.context_ids)
        limit = min(left_total, left_context)
        if self.max_turn_tokens is not None:
            limit = min(limit, self.max_turn_tokens)
        return max(0, limit)

    def tool_rounds_left(self, rounds_done: int) -> bool:
        return self.max_tool_calling_iterations is None or rounds_done < self.max_tool_calling_iterations

    def fit_tool_message(self, message: dict[str, Any], tokenizer: Any) -> tuple[dict[str, Any], bool]:
        """A tool message under ``max_tool_response_tokens`` (its content's tokens): (message, whether it changed).
        "truncate" keeps the first tokens of the content; "drop" replaces the content by a notice the model reads
        (the call keeps its answer, so the template still pairs them)."""
        cap, content = self.max_tool_response_tokens, message.get("content")
        if cap is None or not isinstance(content, str):
            return message, False
        ids = tokenizer(content, add_special_tokens=False)["input_ids"]
        if len(ids) <= cap:
            return message, False
        if self.tool_response_overflow == "drop":
            notice = str({"error": f"the tool's response ({len(ids)} tokens) exceeded {cap} tokens and was dropped."})
            return {**message, "content": notice}, True
        return {**message, "content": tokenizer.decode(ids[:cap])}, True
