"""The embedded tool-calling model (trlx_scale/tasks/tool_model.py) and its calculator task: it loads, its tokenizer
passes TRL's tool checks, and pre-training left it calling the tool on part of the held-out problems, right when it
does and mostly wrong when it answers directly."""

from __future__ import annotations

import pytest
import torch

from trlx_scale.tasks.calculator_task import (
    add,
    calculator_dataset,
    calculator_problems,
    exact_answer,
    split_calculator_problems,
)
from trlx_scale.tasks.tool_chat_template import TOOL_CHAT_TEMPLATE, TOOL_RESPONSE_TEMPLATE
from trlx_scale.tasks.tool_model import (
    FIRST_TURN_TOKENS,
    _greedy,
    _render,
    encode_conversation,
    evaluate_with_tool,
    load_tool_model_tokenizer,
    tool_model_path,
)


@pytest.fixture(scope="module")
def tool_tokenizer():
    return load_tool_model_tokenizer()


@pytest.fixture(scope="module")
def tool_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tool_model_path(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def held_out_evaluation(tool_model, tool_tokenizer):
    return evaluate_with_tool(tool_model, tool_tokenizer, calculator_problems("held_out", size=120))


def test_task_split_is_deterministic_and_disjoint():
    train, held_out = split_calculator_problems()
    assert (len(train), len(held_out)) == (22500, 2500)
    assert not {p.numbers for p in train} & {p.numbers for p in held_out}
    assert split_calculator_problems() == (train, held_out)
    row = calculator_dataset("held_out", size=3)[0]
    assert row["prompt"] == [{"role": "user", "content": held_out[0].question}]
    assert row["answer"] == str(sum(held_out[0].numbers))
    assert add([123, 456, 789]) == 1368
    with pytest.raises(TypeError):
        add("1, 2")


def test_exact_answer_reads_the_last_assistant_message():
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add"}}]}
    completions = [
        [call, {"role": "tool", "content": "1368"}, {"role": "assistant", "content": "1368"}],
        [call, {"role": "tool", "content": "1368"}, {"role": "assistant", "content": "1367"}],
        [{"role": "assistant", "content": " 1368 "}],
        [call],  # the call never answered
    ]
    assert exact_answer(completions, answer=["1368"] * 4) == [1.0, 0.0, 1.0, 0.0]


def test_tokenizer_loads_with_tool_templates_and_passes_trl_checks(tool_tokenizer):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    saved = AutoTokenizer.from_pretrained(tool_model_path())  # save_pretrained kept both templates
    assert saved.chat_template == TOOL_CHAT_TEMPLATE
    assert saved.response_template == TOOL_RESPONSE_TEMPLATE
    assert tool_tokenizer.chat_template == TOOL_CHAT_TEMPLATE
    assert supports_tool_calling(tool_tokenizer)
    assert is_chat_template_prefix_preserving(tool_tokenizer)
    assert tool_tokenizer.model_max_length == 256


def test_pretraining_loss_covers_the_assistant_turns_only(tool_tokenizer):
    problem = calculator_problems("train", size=1)[0]
    ids, labels = encode_conversation(tool_tokenizer, problem, use_tool=True)
    assert len(ids) <= 128  # a whole episode fits the model's 256 positions with room to spare
    trained = tool_tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != -100])
    numbers = ", ".join(str(n) for n in problem.numbers)
    assert trained == (
        f'<call>{{"name": "add", "arguments": {{"numbers": [{numbers}]}}}}</call><|end|>{problem.answer}<|end|>'
    )
    ids, labels = encode_conversation(tool_tokenizer, problem, use_tool=False)
    assert tool_tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != -100]) == (
        f"{problem.answer}<|end|>"
    )


def test_greedy_first_turns_parse_into_tool_calls_and_direct_answers(tool_model, tool_tokenizer):
    from trl.chat_template_utils import parse_response

    problems = calculator_problems("held_out", size=60)
    prompts = [
        tool_tokenizer(_render(tool_tokenizer, [{"role": "user", "content": p.question}], True))["input_ids"]
        for p in problems
    ]
    turns = _greedy(tool_model, tool_tokenizer, prompts, FIRST_TURN_TOKENS)
    calls, direct = 0, 0
    for problem, prompt, turn in zip(problems, prompts, turns, strict=True):
        assert turn[-1] == tool_tokenizer.eos_token_id  # every turn ends, none runs into the token limit
        message = parse_response(tool_tokenizer, turn, prefix=prompt, tools=[add])
        if message.get("tool_calls"):
            calls += 1
            (call,) = message["tool_calls"]
            assert call["function"] == {"name": "add", "arguments": {"numbers": list(problem.numbers)}}
        else:
            direct += 1
            assert message["content"].isdigit() and 3 <= len(message["content"]) <= 4  # a sum is 300 to 2997
    assert calls >= 10 and direct >= 10, (calls, direct)


def test_the_tool_makes_it_right(held_out_evaluation):
    result = held_out_evaluation
    assert 0.2 <= result["tool_call_rate"] <= 0.8, result
    assert result["tool_accuracy"] >= 0.9, result
    assert result["direct_accuracy"] <= 0.2, result
    assert result["tool_accuracy"] > result["direct_accuracy"] + 0.5, result
    # Room for RL: calling the tool everywhere would be right far more often than the model is now.
    assert result["accuracy"] <= 0.85, result


@pytest.mark.slow
def test_grpo_with_the_tool_raises_held_out_accuracy(tmp_path, capsys):
    """examples/grpo_tools.py (``trlx-scale grpo --task calculator_tools``), shortened: 10 GRPO steps with tools=[add]
    on the concurrent tool loop raise greedy held-out accuracy (the tool executed) by at least 5 points (the full 30
    steps: 60% -> 99-100%, docs), and the model calls the tool more often."""
    import importlib.util
    import os
    import re

    from .helpers.launch import REPO_ROOT

    spec = importlib.util.spec_from_file_location("grpo_tools", os.path.join(REPO_ROOT, "examples", "grpo_tools.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--max_steps", "10", "--eval_size", "100", "--output_dir", str(tmp_path)])
    assert result["accuracy_after"] >= result["accuracy_before"] + 0.05, result
    rates = [float(rate) for rate in re.findall(r"tool called on ([0-9.]+)%", capsys.readouterr().out)]
    assert len(rates) == 2 and rates[1] > rates[0], rates  # before and after
    assert (tmp_path / "run_summary.json").is_file() and (tmp_path / "model.safetensors").is_file()


def test_the_tool_task_is_refused_where_it_cannot_run():
    """--task calculator_tools names the commands that train with tools, and does not mix with a dataset."""
    from trlx_scale.scripts import async_grpo, dpo, grpo, ppo
    from trlx_scale.tasks.example_runtime import parse_example_flags

    _, config, model_args, _ = parse_example_flags(grpo.EXAMPLE, ["--task", "calculator_tools", "--max_steps", "3"])
    assert model_args.model_name_or_path.endswith("embedded_tool_model") and not model_args.use_peft
    assert config.max_steps == 3 and config.max_tool_calling_iterations == 1 and config.max_completion_length == 100
    _, config, _, _ = parse_example_flags(async_grpo.EXAMPLE, ["--task", "calculator_tools"])
    assert config.max_staleness == 0 and config.max_tool_calling_iterations == 1  # measured on this task (docs)
    for script in (ppo, dpo):
        with pytest.raises(ValueError, match="run it with `trlx-scale grpo` or `trlx-scale async_grpo`"):
            parse_example_flags(script.EXAMPLE, ["--task", "calculator_tools"])
    with pytest.raises(ValueError, match="--dataset_name 'me/data' names another"):
        parse_example_flags(grpo.EXAMPLE, ["--task", "calculator_tools", "--dataset_name", "me/data"])
    with pytest.raises(ValueError, match="--task must be one of"):
        parse_example_flags(grpo.EXAMPLE, ["--task", "calculator"])
