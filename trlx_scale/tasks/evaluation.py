"""Held-out exact-match accuracy of a policy (greedy decoding with HF ``generate``).

Evaluation uses the training-side model, not the vLLM engine, so it measures the weights that were actually trained
(and are saved), independently of any weight sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .addition import AdditionProblem, completion_text

Prompt = str | list[dict]


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> str:
    """Text the model sees for a prompt: chat template for conversations, the string itself otherwise."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)


@torch.no_grad()
def greedy_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    batch_size: int = 256,
    progress: bool = False,
) -> list[str]:
    """Greedy completions (special tokens removed) for each prompt, in order; ``progress`` shows a bar per batch."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only generation continues from the right end of every row
    texts: list[str] = []
    try:
        starts = range(0, len(prompts), batch_size)
        for start in tqdm(starts, desc="held-out evaluation", unit="batch", disable=not progress, leave=False):
            rendered = [render_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
            encoded = tokenizer(rendered, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            output = model.generate(
                **encoded,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            texts += tokenizer.batch_decode(output[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return texts


def exact_match_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    answers: Sequence[str],
    max_new_tokens: int = 8,
    batch_size: int = 256,
    progress: bool = False,
) -> float:
    """Fraction of prompts whose greedy completion, stripped, equals the answer."""
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt to evaluate.")
    if len(prompts) != len(answers):
        raise ValueError(f"prompts ({len(prompts)}) and answers ({len(answers)}) must have the same length.")
    texts = greedy_completions(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size, progress=progress
    )
    correct = sum(completion_text(t).strip() == str(a).strip() for t, a in zip(texts, answers, strict=True))
    return correct / len(prompts)


def greedy_accuracy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: Sequence[AdditionProblem]
) -> float:
    """Exact-match accuracy on addition problems, asked through the chat template."""
    prompts = [[{"role": "user", "content": p.question}] for p in problems]
    return exact_match_accuracy(model, tokenizer, prompts, [p.answer for p in problems], max_new_tokens=6)
