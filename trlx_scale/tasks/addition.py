"""The embedded toy task: two-digit addition with a verifiable, exact-match reward.

Problems are split deterministically into a training set (used to pre-train the default model and as RL prompts)
and a held-out set (used only to measure accuracy), so that the accuracy printed before and after RL is measured on
problems the model never trained on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from datasets import Dataset

# Every 5th pair (a, b) in a fixed shuffled order is held out: about 2000 of the 10000 problems.
_SPLIT_SEED = 1234
_HELD_OUT_EVERY = 5


@dataclass(frozen=True)
class AdditionProblem:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def _all_problems(max_operand: int = 99) -> list[AdditionProblem]:
    problems = [AdditionProblem(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(_SPLIT_SEED).shuffle(problems)
    return problems


def split_problems(max_operand: int = 99) -> tuple[list[AdditionProblem], list[AdditionProblem]]:
    """Return ``(train, held_out)``; disjoint, deterministic, independent of any global random state."""
    problems = _all_problems(max_operand)
    held_out = [p for i, p in enumerate(problems) if i % _HELD_OUT_EVERY == 0]
    train = [p for i, p in enumerate(problems) if i % _HELD_OUT_EVERY != 0]
    return train, held_out


def _to_rows(problems: list[AdditionProblem], conversational: bool) -> dict[str, list]:
    if conversational:
        prompts = [[{"role": "user", "content": p.question}] for p in problems]
    else:
        prompts = [p.question for p in problems]
    return {"prompt": prompts, "answer": [p.answer for p in problems]}


def addition_dataset(split: str = "train", size: int | None = None, conversational: bool = True) -> Dataset:
    """A TRL prompt-only dataset (``prompt`` + ``answer`` columns) for the addition task.

    Args:
        split: ``"train"`` (RL prompts) or ``"held_out"`` (evaluation only).
        size: keep the first ``size`` problems of the split (its order is already shuffled).
        conversational: chat-style prompts (a list of messages, rendered by the tokenizer's chat template) when true,
            plain text prompts otherwise.
    """
    train, held_out = split_problems()
    if split == "train":
        problems = train
    elif split == "held_out":
        problems = held_out
    else:
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}.")
    if size is not None:
        if size <= 0:
            raise ValueError(f"size must be a positive number of problems, got {size}.")
        if size > len(problems):
            raise ValueError(
                f"size={size} asks for more problems than the {split!r} split has ({len(problems)}); ask for at most "
                f"{len(problems)} (--train_size / --eval_size in the examples)."
            )
        problems = problems[:size]
    return Dataset.from_dict(_to_rows(problems, conversational))


def wrong_answer(problem: AdditionProblem) -> str:
    """A plausible wrong answer (off by 1 to 10), the same for a problem on every call."""
    rng = random.Random(problem.a * 1000 + problem.b)
    correct = problem.a + problem.b
    offset = rng.choice([d for d in range(-10, 11) if d != 0 and correct + d >= 0])
    return str(correct + offset)


def addition_preference_dataset(split: str = "train", size: int | None = None) -> Dataset:
    """A TRL preference dataset (conversational ``prompt``/``chosen``/``rejected``) for the addition task: the
    correct answer is chosen over a wrong one. Same splits and order as ``addition_dataset``."""
    prompts = addition_dataset(split, size)
    train, held_out = split_problems()
    problems = (train if split == "train" else held_out)[: len(prompts)]
    return Dataset.from_dict(
        {
            "prompt": prompts["prompt"],
            "chosen": [[{"role": "assistant", "content": p.answer}] for p in problems],
            "rejected": [[{"role": "assistant", "content": wrong_answer(p)}] for p in problems],
        }
    )


def completion_text(completion: str | list[dict]) -> str:
    """The generated text of a completion, in TRL's standard (str) or conversational (list of messages) format."""
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content", "") or "" for message in completion)


def exact_match_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """1.0 when the completion is exactly the answer (surrounding whitespace ignored), else 0.0.

    Follows TRL's reward-function signature: extra dataset columns (here ``answer``) arrive as keyword lists.
    """
    return [
        1.0 if completion_text(completion).strip() == str(expected) else 0.0
        for completion, expected in zip(completions, answer, strict=True)
    ]
