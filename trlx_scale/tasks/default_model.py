"""The embedded default model: a tiny Llama-architecture causal LM pre-trained on two-digit addition.

No model can be downloaded where this project is tested, so it ships its own: the weights (about 3 MB) live in
``trlx_scale/tasks/embedded_model/`` and were produced by :func:`build_default_model` (run
``python -m trlx_scale.tasks.default_model --output trlx_scale/tasks/embedded_model``). The build is deterministic on a
given torch build (fixed seeds, single-threaded data order).

Why these sizes:
- byte-level tokenizer without merges: every byte is one token, so any text (also a Hub dataset's) is encodable and
  both transformers and vLLM load it through the standard ``tokenizer.json`` path;
- ``head_dim`` 64: vLLM's CPU attention kernel supports only some head sizes (32, 64, 80, ...), not 16;
- pre-trained only until it solves *some* held-out problems (about a third), so RL has something to improve.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from .addition import AdditionProblem, split_problems

DEFAULT_MODEL_DIR = Path(__file__).parent / "embedded_model"

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|end|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN]

# A minimal chat template: one role marker per message, the assistant's turn closed by the EOS token.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}" + SYSTEM_TOKEN + "{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}" + USER_TOKEN + "{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}" + ASSISTANT_TOKEN + "{{ message['content'] }}" + EOS_TOKEN + ""
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + ASSISTANT_TOKEN + "{%- endif -%}"
)


def default_model_path() -> str:
    """Path of the shipped default model (HF format: config, safetensors, tokenizer with chat template)."""
    if not (DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"The embedded default model is missing from {DEFAULT_MODEL_DIR}. Rebuild it with "
            f"`python -m trlx_scale.tasks.default_model --output {DEFAULT_MODEL_DIR}` (about 2 minutes on 2 cores)."
        )
    return str(DEFAULT_MODEL_DIR)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges (one token per byte) plus the chat special tokens."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=256,
    )


def build_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def _encode_examples(
    tokenizer: PreTrainedTokenizerFast, problems: list[AdditionProblem]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``labels`` with the loss on the assistant's answer and EOS only."""
    rows, label_rows = [], []
    for problem in problems:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": problem.question}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(problem.answer + EOS_TOKEN, add_special_tokens=False)["input_ids"]
        rows.append(prompt_ids + answer_ids)
        label_rows.append([-100] * len(prompt_ids) + answer_ids)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (row, label_row) in enumerate(zip(rows, label_rows, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(label_row)] = torch.tensor(label_row)
    return input_ids, labels


def build_default_model(
    output_dir: str | Path,
    target_accuracy: float = 0.4,
    max_steps: int = 4000,
    check_every: int = 100,
    batch_size: int = 128,
    learning_rate: float = 3e-3,
    seed: int = 0,
) -> dict:
    """Build tokenizer + model, pre-train on the training split of the addition task, save in HF format.

    Training stops at the first check where greedy accuracy on 300 *training* problems reaches ``target_accuracy``
    (the held-out split is never looked at while training), so the model solves some problems but not most and RL has
    room to improve it. Returns a summary with the held-out greedy accuracy of the saved model.
    """
    from .evaluation import greedy_accuracy  # evaluation imports the data module; keep this module light

    if not 0 < target_accuracy < 1:
        raise ValueError(f"target_accuracy must be in (0, 1), got {target_accuracy}.")
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    model = LlamaForCausalLM(build_config(tokenizer))
    train, held_out = split_problems()
    input_ids, labels = _encode_examples(tokenizer, train)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = 50
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    train_accuracy, step = 0.0, 0
    model.train()
    for step in range(1, max_steps + 1):
        index = torch.randint(0, len(train), (batch_size,), generator=generator)
        loss = model(input_ids=input_ids[index], labels=labels[index]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % check_every == 0:
            train_accuracy = greedy_accuracy(model, tokenizer, train[:300])
            elapsed = time.perf_counter() - start
            print(f"step {step:5d}  loss {loss.item():.4f}  train accuracy {train_accuracy:.3f}  ({elapsed:.0f}s)")
            if train_accuracy >= target_accuracy:
                break
    model.eval()
    accuracy = greedy_accuracy(model, tokenizer, held_out[:500])
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    summary = {
        "steps": step,
        "train_accuracy": train_accuracy,
        "held_out_accuracy": accuracy,
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(f"held-out greedy accuracy {accuracy:.3f} after {step} steps; saved to {output_dir}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=build_default_model.__doc__)
    parser.add_argument("--output", default=str(DEFAULT_MODEL_DIR), help="directory to write the HF model to")
    parser.add_argument("--target_accuracy", type=float, default=0.4, help="stop once training accuracy reaches it")
    parser.add_argument("--max_steps", type=int, default=4000, help="give up after this many steps")
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build_default_model(
        args.output,
        target_accuracy=args.target_accuracy,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
    )


if __name__ == "__main__":
    main()
