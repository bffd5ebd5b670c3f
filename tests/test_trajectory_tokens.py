"""agents/trajectory_tokens.py: a trajectory keeps the tokens as sampled, observations rendered alone and masked out,
the template's rendering checked against them, and budgets for the next turn."""

from __future__ import annotations

import pytest

from trlx_scale.agents.trajectory_tokens import ObservationRenderer, TemplateError, TrajectoryTokens, TurnBudget

# A tool-capable template on the embedded model's tokens (its own has no tool role): tool calls rendered after the
# content, tool results after a "<tool>" marker, every assistant turn closed by the end token.
TOOL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|user|>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>{{ message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "<call>{{ call['function']['name'] }}({{ call['function']['arguments'] | tojson }})</call>"
    "{%- endfor -%}<|end|>"
    "{%- elif message['role'] == 'tool' -%}<tool>{{ message['content'] }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
# Qwen3's trap: an earlier assistant turn's content is dropped once a later message follows it.
DROPS_HISTORY = TOOL_TEMPLATE.replace(
    "<|assistant|>{{ message['content'] }}", "<|assistant|>{{ message['content'] if loop.last else '' }}"
)


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_masks_by_hand_end_of_turn_trained_tool_tokens_not(default_tokenizer):
    renderer = ObservationRenderer(default_tokenizer, chat_template=TOOL_TEMPLATE)
    prompt = [{"role": "user", "content": "12+30="}]
    prompt_ids = renderer.render(prompt, add_generation_prompt=True)
    assert prompt_ids == _ids(default_tokenizer, "<|user|>12+30=<|assistant|>")
    tokens = TrajectoryTokens(prompt_ids)
    first = _ids(default_tokenizer, '<call>add({"a": 12, "b": 30})</call><|end|>')
    tokens.add_sampled(first, [-0.5] * len(first))
    tool = {"role": "tool", "name": "add", "content": "42"}
    observation = renderer.observation_ids([tool])
    assert observation == _ids(default_tokenizer, "<tool>42<|assistant|>")  # the result and the next header only
    tokens.add_observation(observation)
    answer = _ids(default_tokenizer, "42<|end|>")
    tokens.add_sampled(answer, [-0.1] * len(answer))
    assert tokens.loss_mask == [1] * len(first) + [0] * len(observation) + [1] * len(answer)
    assert tokens.loss_mask[len(first) - 1] == 1 and first[-1] == default_tokenizer.eos_token_id  # end token trained
    assert tokens.logprobs == [-0.5] * len(first) + [0.0] * len(observation) + [-0.1] * len(answer)
    assert tokens.turns == 2
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 30}}}
    conversation = prompt + [{"role": "assistant", "content": "", "tool_calls": [call]}, tool]
    assert (
        renderer.first_mismatch(conversation, tokens.context_ids[: len(prompt_ids) + len(first) + len(observation)])
        is None
    )


def test_a_template_that_drops_history_is_refused_with_the_fix(default_tokenizer):
    renderer = ObservationRenderer(default_tokenizer, chat_template=DROPS_HISTORY)
    with pytest.raises(TemplateError, match="not prefix-preserving.*get_training_chat_template"):
        renderer.observation_ids([{"role": "tool", "name": "add", "content": "42"}])


def test_decode_reencode_drift_is_found_where_it_starts(default_tokenizer):
    """The model sampled the bytes of "<|end|>" inside its answer: decoded and re-encoded, they become the one end
    token, so the template's rendering differs from the held ids from there on."""
    renderer = ObservationRenderer(default_tokenizer, chat_template=TOOL_TEMPLATE)
    prompt = [{"role": "user", "content": "hi"}]
    held = renderer.render(prompt, add_generation_prompt=True)
    spelled = [default_tokenizer.convert_tokens_to_ids(c) for c in "ok<|end|>"]  # byte tokens, not the special one
    conversation = prompt + [{"role": "assistant", "content": default_tokenizer.decode(spelled)}]
    assert renderer.first_mismatch(conversation, held + spelled) == len(held) + 2


def test_each_turn_gets_the_least_of_its_budgets():
    budget = TurnBudget(max_completion_length=25, max_model_len=40, max_turn_tokens=8)
    tokens = TrajectoryTokens(list(range(10)), completion_ids=list(range(20)), loss_mask=[1] * 20, logprobs=[0.0] * 20)
    assert budget.next_turn_tokens(tokens) == 5  # the trajectory's total, not the per-turn 8 nor the context's 10
    long_prompt = TrajectoryTokens(list(range(36)))
    assert budget.next_turn_tokens(long_prompt) == 4  # the context: prompt + max_tokens never exceeds max_model_len
    full = TrajectoryTokens(list(range(40)))
    assert budget.next_turn_tokens(full) == 0
    assert budget.tool_rounds_left(100)
    assert not TurnBudget(10, 10, max_tool_calling_iterations=2).tool_rounds_left(2)
    with pytest.raises(ValueError, match="tool_response_overflow must be one of"):
        TurnBudget(10, 10, tool_response_overflow="wrap")


def test_a_long_tool_response_is_truncated_or_replaced(default_tokenizer):
    message = {"role": "tool", "name": "search", "content": "abcdefghij"}
    cut, changed = TurnBudget(50, 100, max_tool_response_tokens=4).fit_tool_message(message, default_tokenizer)
    assert changed and cut["content"] == "abcd" and message["content"] == "abcdefghij"
    dropped, changed = TurnBudget(50, 100, max_tool_response_tokens=4, tool_response_overflow="drop").fit_tool_message(
        message, default_tokenizer
    )
    assert changed and "exceeded 4 tokens and was dropped" in dropped["content"]
    same, changed = TurnBudget(50, 100).fit_tool_message(message, default_tokenizer)
    assert not changed and same is message


def test_a_discarded_trajectory_trains_nothing():
    tokens = TrajectoryTokens([1, 2])
    tokens.add_sampled([3, 4], [-1.0, -1.0])
    tokens.discarded = True
    assert tokens.trained_mask == [0, 0] and tokens.loss_mask == [1, 1]
    with pytest.raises(ValueError, match="2 tokens and 1 log-probs"):
        tokens.add_sampled([5, 6], [-1.0])


def test_token_versions_follow_the_ids_while_every_turn_reports_them():
    tokens = TrajectoryTokens(prompt_ids=[1])
    tokens.add_sampled([4, 5], [-0.1, -0.2], versions=[0, 1])  # a reload landed after the first token
    tokens.add_observation([7, 8])  # not sampled: the version before it
    tokens.add_sampled([9], [-0.3], versions=[1])
    assert tokens.versions == [0, 1, 1, 1, 1] and len(tokens.versions) == len(tokens.completion_ids)
    tokens.add_sampled([3], [-0.4])  # a turn that reports none: the trajectory has none
    assert tokens.versions is None
    unversioned = TrajectoryTokens(prompt_ids=[1])
    unversioned.add_sampled([4], [-0.1])
    unversioned.add_observation([7])
    unversioned.add_sampled([9], [-0.3], versions=[1])
    assert unversioned.versions is None
