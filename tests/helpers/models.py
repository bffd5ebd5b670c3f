"""Small model configs built locally (no Hub access in tests)."""

from __future__ import annotations

# A small GQA Llama: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, MLP 128, vocabulary 100, untied head:
# 86,848 parameters (counted by hand in tests/test_planning.py).
TINY_LLAMA = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
    intermediate_size=128,
    tie_word_embeddings=False,
)


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(**TINY_LLAMA)
