"""A model and data the package did not build, as a user brings them: a small Qwen2 (another architecture than the
embedded Llama) with a byte-level BPE tokenizer trained here and a ChatML template, saved as HF model files."""

from __future__ import annotations

import json

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def user_prompt(index: int) -> str:
    return f"What is {index} plus {index % 7}? Answer with digits."


def user_answer(index: int) -> str:
    return str(index + index % 7)


def save_user_model(folder) -> str:
    """Save the model and tokenizer into ``folder``; return its path. Head size 32: one vLLM's CPU kernels take."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [f"{user_prompt(i)} {user_answer(i)}" for i in range(200)] + ["user assistant system 0123456789"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML_TEMPLATE
    )
    return _save(folder, Qwen2Config(**_small_decoder(tokenizer), tie_word_embeddings=True), tokenizer)


def _small_decoder(tokenizer) -> dict:
    """The fields of a 2-layer, 64-wide decoder over ``tokenizer`` (head size 32: one vLLM's CPU kernels take)."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


def _save(folder, config, tokenizer) -> str:
    """A model of ``config`` with random weights (seeded), saved beside ``tokenizer`` as HF model files."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def write_prompt_parquet(path, rows: int) -> str:
    """A local parquet file of ``rows`` conversational prompts with an ``answer`` column."""
    from datasets import Dataset

    Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": user_prompt(i)}] for i in range(rows)],
            "answer": [user_answer(i) for i in range(rows)],
        }
    ).to_parquet(str(path))
    return str(path)


def write_preference_jsonl(path, rows: int) -> str:
    """A local JSONL file of ``rows`` preference pairs (TRL's prompt/chosen/rejected, plain text)."""
    with open(path, "w") as handle:
        for i in range(rows):
            answer = int(user_answer(i))
            row = {"prompt": user_prompt(i), "chosen": f" {answer}", "rejected": f" {answer + 1}"}
            handle.write(json.dumps(row) + "\n")
    return str(path)


# The reward a user's module holds: written into the run's working directory, named `user_rewards.digit_reward`.
USER_REWARD_MODULE = '''
def digit_reward(completions, **kwargs):
    """1.0 when the completion holds a digit."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(any(ch.isdigit() for ch in text)) for text in texts]
'''


def save_shrunk_model(folder, model_type: str) -> str:
    """A 2-layer, 64-wide model of ``model_type``'s architecture (qwen2, qwen3_moe with 4 experts, llama), random
    weights, with the embedded model's tokenizer: a recipe's own architecture at a size CPU tests can train."""
    from transformers import AutoTokenizer, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    from trlx_scale.tasks.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    fields = _small_decoder(tokenizer)
    configs = {
        "qwen2": lambda: Qwen2Config(**fields),
        "llama": lambda: LlamaConfig(**fields),
        "qwen3_moe": lambda: Qwen3MoeConfig(
            **fields, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
        ),
    }
    return _save(folder, configs[model_type](), tokenizer)


def write_math_folder(folder, rows: int) -> str:
    """A local stand-in for trl-lib/DeepMath-103K: conversational 'prompt', a LaTeX 'solution' (what accuracy_reward
    checks) and an 'answer' (what exact_match checks), in a JSONL train split."""
    folder.mkdir()
    with open(folder / "train.jsonl", "w") as handle:
        for i in range(rows):
            a, b = 10 + i, 3 + i % 5
            row = {
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "solution": f"${a + b}$",
                "answer": str(a + b),
            }
            handle.write(json.dumps(row) + "\n")
    return str(folder)


def write_preference_folder(folder, rows: int, test_rows: int) -> str:
    """Preference pairs in a folder with train and test splits (trl-lib/ultrafeedback_binarized's layout)."""
    folder.mkdir()
    write_preference_jsonl(folder / "train.jsonl", rows)
    write_preference_jsonl(folder / "test.jsonl", test_rows)
    return str(folder)
