"""Locally built models and tokenizers for the benchmarks (no Hub access): HF files a vLLM engine can load.

A randomly initialised Llama- or Qwen2-shaped causal LM and a word-level tokenizer over the same vocabulary
("t0" .. "t{V-1}", one token per word), so a prompt of N words is exactly N tokens and any sampled id decodes.
"""

from __future__ import annotations

import json
import os
import random

import torch

ASSET_ROOT = os.environ.get("TRLX_SCALE_BENCH_ASSETS", "/tmp/trlx_scale_bench_assets")


def build_word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_model_dir(name: str, config, dtype: torch.dtype = torch.float32, seed: int = 0) -> str:
    """Save a random model of ``config`` and the word tokenizer under ASSET_ROOT/name (reused when present)."""
    from transformers import AutoModelForCausalLM

    path = os.path.join(ASSET_ROOT, name)
    marker = os.path.join(path, "config.json")
    if os.path.isfile(marker):
        return path
    torch.manual_seed(seed)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 1, 1
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    temporary = path + ".partial"
    model.save_pretrained(temporary)
    build_word_tokenizer(config.vocab_size).save_pretrained(temporary)
    os.replace(temporary, path)  # complete or absent
    return path


def llama_30m(max_positions: int = 512):
    """~30M parameters: 4 layers, hidden 512, 8 heads of 64, MLP 1408, vocabulary 32000, tied embeddings."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1408,
        vocab_size=32000,
        tie_word_embeddings=True,
        max_position_embeddings=max_positions,
    )


def llama_small(max_positions: int = 512):
    """~1.6M parameters (4 layers, hidden 128, 2 heads of 64, vocabulary 2000): where TRL's colocated sync runs."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=352,
        vocab_size=2000,
        tie_word_embeddings=True,
        max_position_embeddings=max_positions,
    )


def qwen2_05b(max_positions: int = 2048):
    """Qwen2-0.5B's shape (24 layers, hidden 896, 14 heads, 2 KV heads, MLP 4864, vocabulary 151936, tied)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=max_positions,
    )


def word_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[str]:
    """``count`` prompts of exactly ``length`` tokens for the word tokenizer."""
    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(3, vocab_size)}" for _ in range(length)) for _ in range(count)]


def dump(path: str, payload: dict) -> None:
    temporary = path + ".partial"
    with open(temporary, "w") as handle:
        json.dump(payload, handle, indent=2)
    os.replace(temporary, path)
