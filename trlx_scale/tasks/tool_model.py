"""The embedded tool-calling model: the default model's architecture, pre-trained to call a calculator on part of a task.

The task (``calculator_task``) is the sum of three three-digit numbers, which the tiny model cannot compute in its head.
Its pre-training conversations mix two behaviours: answering directly (the model learns the format but gets few sums
right) and calling the ``add`` tool, then answering with the tool's result (nearly always right). Which one a training
conversation shows depends on the problem: with probability 0.8 a call when the first number's leading digit is 5 or
more, with probability 0.2 otherwise. The pre-trained model therefore calls the tool on about half the held-out problems
(greedy) and samples both behaviours on every problem, so GRPO with ``tools=[add]`` can learn to call it more, and
held-out accuracy rises.

The weights (a few MB) live in ``trlx_scale/tasks/embedded_tool_model/`` and were produced by
``python -m trlx_scale.tasks.tool_model --output trlx_scale/tasks/embedded_tool_model`` (deterministic on a given torch
build: fixed seeds, single-threaded data order).

Its tokenizer carries the tool-calling chat template (``TOOL_CHAT_TEMPLATE``) and the response template that parses a
sampled turn (``TOOL_RESPONSE_TEMPLATE``); ``save_pretrained`` keeps both (``tokenizer_config.json``), and
``load_tool_model_tokenizer`` sets them again should an older file lack them.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from .calculator_task import CalculatorProblem, add, split_calculator_problems
from .default_model import build_config, build_tokenizer
from .tool_chat_template import TOOL_CHAT_TEMPLATE, TOOL_RESPONSE_TEMPLATE

TOOL_MODEL_DIR = Path(__file__).parent / "embedded_tool_model"

# Tokens of the first turn (a tool call is about 65, ``</call><|end|>`` included) and of the answer after the tool.
FIRST_TURN_TOKENS = 80
ANSWER_TOKENS = 8


def tool_model_path() -> str:
    """Path of the shipped tool-calling model (HF format: config, safetensors, tokenizer with the tool templates)."""
    if not (TOOL_MODEL_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"The embedded tool model is missing from {TOOL_MODEL_DIR}. Rebuild it with "
            f"`python -m trlx_scale.tasks.tool_model --output {TOOL_MODEL_DIR}` (a few minutes on 2 cores)."
        )
    return str(TOOL_MODEL_DIR)


def tool_model_tokenizer() -> PreTrainedTokenizerBase:
    """The default model's byte-level tokenizer with the tool-calling chat and response templates."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.response_template = copy.deepcopy(TOOL_RESPONSE_TEMPLATE)
    return tokenizer


def load_tool_model_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(path)`` (the shipped model's by default), with the tool templates ensured."""
    tokenizer = AutoTokenizer.from_pretrained(str(path or tool_model_path()))
    if getattr(tokenizer, "response_template", None) is None:
        tokenizer.response_template = copy.deepcopy(TOOL_RESPONSE_TEMPLATE)
    if tokenizer.chat_template is None:  # a saved template is kept: it is the one the model was trained on
        tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return tokenizer


# ----------------------------------------------------------------------------------------------- pre-training data
def tool_probability(problem: CalculatorProblem) -> float:
    """How often the pre-training data calls the tool on this problem: 0.8 when the first number's leading digit is
    5 or more, 0.2 otherwise (so greedy calls it on about half the problems, and sampling tries both everywhere)."""
    return 0.8 if problem.numbers[0] >= 500 else 0.2


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def tool_call_message(problem: CalculatorProblem) -> dict:
    call = {"type": "function", "function": {"name": "add", "arguments": {"numbers": list(problem.numbers)}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase, problem: CalculatorProblem, use_tool: bool
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one training conversation; the loss is on the assistant's turns (``<|end|>``
    included), not on the prompt, the ``<tool>`` result or the ``<|assistant|>`` header that follows it."""
    user = {"role": "user", "content": problem.question}
    if use_tool:
        messages = [
            user,
            tool_call_message(problem),
            {"role": "tool", "name": "add", "content": str(add(list(problem.numbers)))},
            {"role": "assistant", "content": problem.answer},
        ]
    else:
        messages = [user, {"role": "assistant", "content": problem.answer}]
    # Cut the rendered conversation where each message starts: the template is prefix-preserving.
    boundaries = [_render(tokenizer, [user], True)]
    if use_tool:
        boundaries += [_render(tokenizer, messages[:2], False), _render(tokenizer, messages[:3], True)]
    full = _render(tokenizer, messages, False)
    cuts = [0, *(len(b) for b in boundaries), len(full)]
    input_ids, labels = [], []
    for index, (start, end) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        ids = tokenizer(full[start:end], add_special_tokens=False)["input_ids"]
        input_ids += ids
        labels += ids if index % 2 == 1 else [-100] * len(ids)  # segments: prompt, turn, tool result, answer
    return input_ids, labels


def pretraining_mix(problems: Sequence[CalculatorProblem], seed: int) -> list[bool]:
    """Per problem, whether its training conversation calls the tool (deterministic given ``seed``)."""
    rng = random.Random(seed)
    return [rng.random() < tool_probability(p) for p in problems]


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    out = torch.full((len(rows), max(len(r) for r in rows)), value)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


# -------------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def _greedy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy continuation of each row of token ids, cut after the end token (pads dropped)."""
    device = next(model.parameters()).device
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):  # left padding: generation continues from the right end of every row
        input_ids[i, width - len(row) :] = torch.tensor(row)
        attention[i, width - len(row) :] = 1
    output = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    turns = []
    for row in output[:, width:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        turns.append([t for t in row if t != tokenizer.pad_token_id])
    return turns


def _run_tool(tools: dict[str, Callable], call: dict) -> str:
    """A tool call's result as the tool message shows it (an error as TRL reports one)."""
    function = call.get("function", {})
    try:
        return str(tools[function["name"]](**function["arguments"]))
    except Exception as error:  # noqa: BLE001 - a failed call is a wrong answer, as in training
        return str({"error": str(error)})


def tool_suffix_ids(tokenizer: PreTrainedTokenizerBase, result: str) -> list[int]:
    """Tokens between an assistant's tool call and its next turn: ``<tool>RESULT<|assistant|>`` (rendered by the
    chat template, as TRL's tool loop renders them)."""
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add"}}]}
    call["tool_calls"][0]["function"]["arguments"] = {}
    before = _render(tokenizer, [{"role": "user", "content": "x"}, call], False)
    after = _render(tokenizer, [{"role": "user", "content": "x"}, call, {"role": "tool", "content": result}], True)
    return tokenizer(after[len(before) :], add_special_tokens=False)["input_ids"]


def evaluate_with_tool(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[CalculatorProblem],
    batch_size: int = 256,
) -> dict:
    """Greedy held-out evaluation with the ``add`` tool executed, as in training (one tool round).

    The first turn is generated greedily and parsed with TRL's ``parse_response``; a tool call is run, its result
    appended (``<tool>RESULT<|assistant|>``) and the answer generated greedily. Returns ``accuracy`` (the last
    assistant message equals the sum), ``tool_call_rate``, ``tool_accuracy`` (accuracy where it called the tool),
    ``direct_accuracy`` (accuracy where it answered directly; None when a group is empty) and the counts.
    """
    from trl.chat_template_utils import parse_response

    if len(problems) == 0:
        raise ValueError("problems is empty: pass at least one problem to evaluate.")
    was_training = model.training
    model.eval()
    tools = {"add": add}
    called, correct = [], []
    try:
        for start in range(0, len(problems), batch_size):
            batch = problems[start : start + batch_size]
            prompts = [
                tokenizer(
                    _render(tokenizer, [{"role": "user", "content": p.question}], True), add_special_tokens=False
                )["input_ids"]
                for p in batch
            ]
            turns = _greedy(model, tokenizer, prompts, FIRST_TURN_TOKENS)
            answers: list[str | None] = [None] * len(batch)
            second_rows, second_index = [], []
            for i, (prompt, turn) in enumerate(zip(prompts, turns, strict=True)):
                message = parse_response(tokenizer, turn, prefix=prompt, tools=[add])
                calls = message.get("tool_calls") or []
                called.append(bool(calls))
                if calls:
                    results = [_run_tool(tools, call) for call in calls]
                    suffix = [t for r in results for t in tool_suffix_ids(tokenizer, r)]
                    second_rows.append(prompt + turn + suffix)
                    second_index.append(i)
                else:
                    answers[i] = message.get("content") or ""
            if second_rows:
                for i, turn in zip(second_index, _greedy(model, tokenizer, second_rows, ANSWER_TOKENS), strict=True):
                    answers[i] = tokenizer.decode(turn, skip_special_tokens=True)
            correct += [(a or "").strip() == p.answer for a, p in zip(answers, batch, strict=True)]
    finally:
        model.train(was_training)
    n_tool = sum(called)
    n_direct = len(called) - n_tool
    right_tool = sum(c for c, t in zip(correct, called, strict=True) if t)
    right_direct = sum(c for c, t in zip(correct, called, strict=True) if not t)
    return {
        "accuracy": sum(correct) / len(correct),
        "tool_call_rate": n_tool / len(called),
        "tool_accuracy": right_tool / n_tool if n_tool else None,
        "direct_accuracy": right_direct / n_direct if n_direct else None,
        "tool_calls": n_tool,
        "direct_answers": n_direct,
        "problems": len(called),
    }


def format_evaluation(result: dict) -> str:
    def pct(value):
        return "n/a" if value is None else f"{value:.1%}"

    return (
        f"accuracy {pct(result['accuracy'])} on {result['problems']} problems; tool called on "
        f"{pct(result['tool_call_rate'])} (accuracy {pct(result['tool_accuracy'])}), answered directly on the rest "
        f"(accuracy {pct(result['direct_accuracy'])})"
    )


# ------------------------------------------------------------------------------------------------------- build
def build_tool_model(
    output_dir: str | Path,
    max_steps: int = 500,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    eval_size: int = 200,
    seed: int = 0,
) -> dict:
    """Build the tokenizer and model, pre-train on the training split's mix of direct answers and tool calls, save in
    HF format, and return (and print) a summary with the held-out evaluation (greedy, the tool executed)."""
    torch.manual_seed(seed)
    tokenizer = tool_model_tokenizer()
    model = LlamaForCausalLM(build_config(tokenizer))
    train, held_out = split_calculator_problems()
    uses_tool = pretraining_mix(train, seed)
    encoded = [encode_conversation(tokenizer, p, t) for p, t in zip(train, uses_tool, strict=True)]
    input_ids = _pad([ids for ids, _ in encoded], tokenizer.pad_token_id)
    labels = _pad([lab for _, lab in encoded], -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = 100
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / max_steps)
    )
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    model.train()
    for step in range(1, max_steps + 1):
        index = torch.randint(0, len(train), (batch_size,), generator=generator)
        batch_ids, batch_labels = input_ids[index], labels[index]
        width = int((batch_ids != tokenizer.pad_token_id).sum(1).max())
        loss = model(input_ids=batch_ids[:, :width], labels=batch_labels[:, :width]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 250 == 0:
            print(f"step {step:5d}  loss {loss.item():.4f}  ({time.perf_counter() - start:.0f}s)", flush=True)
    model.eval()
    result = evaluate_with_tool(model, tokenizer, held_out[:eval_size])
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    summary = {
        "steps": max_steps,
        "train_tool_fraction": sum(uses_tool) / len(uses_tool),
        **{f"held_out_{k}": v for k, v in result.items()},
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(f"held-out (greedy, tool executed): {format_evaluation(result)}")
    print(json.dumps(summary))
    print(f"saved to {output_dir}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=build_tool_model.__doc__)
    parser.add_argument("--output", default=str(TOOL_MODEL_DIR), help="directory to write the HF model to")
    parser.add_argument("--max_steps", type=int, default=500)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--eval_size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build_tool_model(
        args.output,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        eval_size=args.eval_size,
        seed=args.seed,
    )


if __name__ == "__main__":
    main()
