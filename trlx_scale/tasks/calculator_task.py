"""The embedded agentic task: sums of three three-digit numbers, with a calculator tool.

The embedded model cannot add three three-digit numbers in its head (a 3-layer, 128-wide model answers only a few per
cent of them), but it can copy the numbers into one call of the ``add`` tool and copy the tool's result back:
``<call>{"name": "add", "arguments": {"numbers": [123, 456, 789]}}</call>``, then ``<tool>1368``, then ``1368``. One
call per problem keeps a whole episode near 100 tokens of the model's 256 (the tokenizer spends one token per byte).

Problems are drawn from a fixed seed and split deterministically into a training set (pre-training and RL prompts)
and a held-out set (accuracy only), independently of any global random state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from datasets import Dataset

NUM_OPERANDS = 3
MIN_OPERAND, MAX_OPERAND = 100, 999
_SPLIT_SEED = 4321
_NUM_PROBLEMS = 25_000
_HELD_OUT_EVERY = 10  # every 10th problem of the fixed draw is held out: 2500 held-out problems


@dataclass(frozen=True)
class CalculatorProblem:
    numbers: tuple[int, ...]

    @property
    def question(self) -> str:
        return "+".join(str(n) for n in self.numbers)

    @property
    def answer(self) -> str:
        return str(sum(self.numbers))


def add(numbers: list[int]) -> int:
    """Add a list of integers.

    Args:
        numbers: The integers to add.
    """
    if not isinstance(numbers, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
        raise TypeError(f"numbers must be a list of integers, got {numbers!r}")
    return sum(numbers)


def _all_problems() -> list[CalculatorProblem]:
    rng = random.Random(_SPLIT_SEED)
    seen: set[tuple[int, ...]] = set()
    problems = []
    while len(problems) < _NUM_PROBLEMS:
        numbers = tuple(rng.randint(MIN_OPERAND, MAX_OPERAND) for _ in range(NUM_OPERANDS))
        if numbers not in seen:  # no problem appears twice, so none is in both splits
            seen.add(numbers)
            problems.append(CalculatorProblem(numbers))
    return problems


_CACHE: dict[str, tuple[list[CalculatorProblem], list[CalculatorProblem]]] = {}


def split_calculator_problems() -> tuple[list[CalculatorProblem], list[CalculatorProblem]]:
    """``(train, held_out)``: disjoint, deterministic (22500 and 2500 problems)."""
    if "split" not in _CACHE:
        problems = _all_problems()
        held_out = [p for i, p in enumerate(problems) if i % _HELD_OUT_EVERY == 0]
        train = [p for i, p in enumerate(problems) if i % _HELD_OUT_EVERY != 0]
        _CACHE["split"] = (train, held_out)
    train, held_out = _CACHE["split"]
    return list(train), list(held_out)


def calculator_problems(split: str = "train", size: int | None = None) -> list[CalculatorProblem]:
    """The first ``size`` problems of ``"train"`` or ``"held_out"`` (all when ``size`` is None)."""
    train, held_out = split_calculator_problems()
    if split == "train":
        problems = train
    elif split == "held_out":
        problems = held_out
    else:
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}.")
    if size is not None:
        if not 0 < size <= len(problems):
            raise ValueError(f"size must be in [1, {len(problems)}] for the {split!r} split, got {size}.")
        problems = problems[:size]
    return problems


def calculator_dataset(split: str = "train", size: int | None = None) -> Dataset:
    """A TRL conversational prompt-only dataset: ``prompt`` ([{"role": "user", ...}]) and ``answer`` columns."""
    problems = calculator_problems(split, size)
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": p.question}] for p in problems],
            "answer": [p.answer for p in problems],
        }
    )


def final_answer(completion: str | list[dict]) -> str:
    """The content of the last assistant message of a completion (the whole text for a plain-text completion)."""
    if isinstance(completion, str):
        return completion.strip()
    for message in reversed(completion):
        if message.get("role") == "assistant":
            return (message.get("content") or "").strip()
    return ""


def exact_answer(completions: list, answer: list[str], **kwargs) -> list[float]:
    """1.0 when the last assistant message is exactly the answer (surrounding whitespace ignored), else 0.0.

    TRL's reward-function signature: ``completions`` are lists of messages (assistant turns, tool results), and the
    dataset's ``answer`` column arrives as a keyword list.
    """
    return [
        1.0 if final_answer(completion) == str(expected).strip() else 0.0
        for completion, expected in zip(completions, answer, strict=True)
    ]
