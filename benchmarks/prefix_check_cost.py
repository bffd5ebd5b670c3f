"""The cost of ``prefix_mismatch="keep"`` (the default): one render of the conversation with the chat template per
later turn of a tool-calling trajectory, as the concurrent loop renders it (``ConcurrentToolLoopMixin
._template_prefix_check``). Measured on the embedded tool model's tokenizer and a three-message conversation (the
question, a call of ``add``, its result); milliseconds per check, the median of 5 timings of 200 checks.

    python benchmarks/prefix_check_cost.py

Result and command: docs/benchmarks.md ("Multi-turn tool calls").
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from trlx_scale.tasks.calculator_task import add
    from trlx_scale.tasks.tool_model import load_tool_model_tokenizer

    tokenizer = load_tool_model_tokenizer()
    call = {"type": "function", "function": {"name": "add", "arguments": {"numbers": [123, 456, 789]}}}
    conversation = [
        {"role": "user", "content": "What is 123 + 456 + 789?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "add", "content": "1368"},
    ]

    def render() -> list[int]:
        return tokenizer.apply_chat_template(
            conversation, tools=[add], add_generation_prompt=True, tokenize=True, return_dict=False
        )

    for _ in range(20):  # warm-up: the template's compilation
        render()
    timings = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(200):
            render()
        timings.append((time.perf_counter() - began) / 200 * 1000)
    print(
        f"{statistics.median(timings):.3f} ms per check (median; {', '.join(f'{t:.3f}' for t in timings)}), "
        f"{len(render())} tokens rendered"
    )


if __name__ == "__main__":
    main()
