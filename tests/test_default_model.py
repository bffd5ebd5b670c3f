"""The embedded default model: HF format, byte-level tokenizer with a chat template, partly solves the task."""

import json
import os

import pytest
import torch

from trlx_scale.tasks.addition import split_problems
from trlx_scale.tasks.evaluation import greedy_accuracy


def test_files_are_hf_format(default_model_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(default_model_dir, name)), name
    config = json.load(open(os.path.join(default_model_dir, "config.json")))
    # vLLM's CPU attention kernel supports head sizes 32, 64, 80, ... only.
    assert config["head_dim"] == config["hidden_size"] // config["num_attention_heads"] == 64


def test_tokenizer_round_trips_any_text_and_renders_chat(default_tokenizer):
    text = "12+34=46 héllo\n\tworld ✓"
    ids = default_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte, no merges
    assert default_tokenizer.decode(ids) == text
    rendered = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}], tokenize=False
    )
    assert rendered == "<|user|>1+2=<|assistant|>3<|end|>"
    prompt = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|user|>1+2=<|assistant|>"
    assert default_tokenizer.eos_token == "<|end|>" and default_tokenizer.pad_token == "<|pad|>"


def test_model_solves_some_but_not_most_held_out_problems(default_model, default_tokenizer):
    _, held_out = split_problems()
    accuracy = greedy_accuracy(default_model, default_tokenizer, held_out[:400])
    # Pre-trained until ~40% train accuracy: RL must have room to improve, and a signal to start from.
    assert 0.2 <= accuracy <= 0.6, accuracy


def test_missing_weights_give_a_rebuild_hint(tmp_path, monkeypatch):
    from trlx_scale.tasks import default_model

    monkeypatch.setattr(default_model, "DEFAULT_MODEL_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="python -m trlx_scale.tasks.default_model"):
        default_model.default_model_path()


@pytest.mark.slow
def test_builder_produces_a_loadable_model(tmp_path):
    """The script that made the shipped weights runs and writes a model transformers loads (short budget here)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trlx_scale.tasks.default_model import build_default_model

    summary = build_default_model(tmp_path, target_accuracy=0.99, max_steps=40, check_every=20)
    assert summary["steps"] == 40 and "held_out_accuracy" in summary
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert model.config.head_dim == 64 and tokenizer.chat_template
    assert torch.isfinite(model(torch.tensor([[3, 10, 11]])).logits).all()
