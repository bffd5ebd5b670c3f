"""The tool-call setting several trainer tests share: an untrained model whose every turn is a call of ``inc(a)``
(structured outputs force the call), on short sums."""

from __future__ import annotations

from datasets import Dataset

from trlx_scale.tasks.tool_chat_template import tool_call_regex


def inc(a: int) -> int:
    """Add one to an integer.

    Args:
        a: The integer.
    """
    return a + 1


def inc_dataset(count: int) -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i}+{i + 1}"}]} for i in range(count)])


# Config fields: every turn of the untrained model is a tool call, so the number of turns is
# max_tool_calling_iterations + 1.
EVERY_TURN_CALLS_INC = dict(
    use_vllm=True,
    vllm_mode="colocate",
    max_steps=1,
    max_completion_length=180,
    vllm_max_model_length=256,
    vllm_structured_outputs_regex=tool_call_regex("inc", ("a",)),
    max_tool_calling_iterations=2,
)


def length_reward(completions, **_) -> list[float]:
    """The number of messages after the prompt."""
    return [float(len(completion)) for completion in completions]
