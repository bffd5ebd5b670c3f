"""Weight-sync choices and streaming without an engine: which adapters vLLM can serve, bucketed full-weight streams."""

from contextlib import contextmanager

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trlx_scale.generation.weight_sync import (
    CPU_MERGED_SYNC_REASON,
    choose_sync_mode,
    full_weight_stream,
    lora_ineligibility,
    vllm_max_lora_rank,
)


def _lora(model, **kwargs):
    return get_peft_model(model, LoraConfig(**{"r": 8, "target_modules": ["q_proj", "v_proj"], **kwargs}))


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["embed_tokens", "q_proj"]}, "embeddings"),
        ({"target_modules": ["lm_head"]}, "LM head"),
        ({"r": 1024}, "exceeds vLLM's largest supported rank 512"),
    ],
)
def test_adapters_vllm_cannot_serve_fall_back_to_full_sync(default_model, kwargs, reason):
    model = _lora(default_model, **kwargs)
    assert reason in lora_ineligibility(model)
    mode, why = choose_sync_mode(model, "auto")
    assert mode == "full" and reason in why
    with pytest.raises(ValueError, match="vllm_sync_mode='lora' is impossible"):
        choose_sync_mode(model, "lora")


def test_plain_lora_is_served_by_vllm(default_model):
    model = _lora(default_model, r=48)
    assert lora_ineligibility(model) is None and choose_sync_mode(model, "auto") == ("lora", None)
    assert choose_sync_mode(model, "full")[0] == "full"
    # On a CPU engine "auto" merges (measured faster per step there); "lora" is still honoured.
    mode, why = choose_sync_mode(model, "auto", cpu_engine=True)
    assert mode == "full" and why == CPU_MERGED_SYNC_REASON and "vllm_sync_mode='lora'" in why
    assert choose_sync_mode(model, "lora", cpu_engine=True) == ("lora", None)
    assert vllm_max_lora_rank(48) == 64 and vllm_max_lora_rank(8) == 8 and vllm_max_lora_rank(513) is None
    assert "not a PEFT model" in lora_ineligibility(default_model)
    with pytest.raises(ValueError, match="vllm_sync_mode must be"):
        choose_sync_mode(model, "merged")


def test_full_weight_stream_gathers_bucket_by_bucket(default_model):
    gathered = []

    @contextmanager
    def recording_gather(params):
        gathered.append(len(params))
        yield

    named = list(default_model.named_parameters())
    counter = {}
    total_bytes = sum(p.numel() * 2 for _, p in named)
    stream = full_weight_stream(
        named, recording_gather, torch.bfloat16, bucket_bytes=total_bytes // 4, counter=counter
    )
    out = list(stream)
    assert [n for n, _ in out] == [n for n, _ in named]
    assert all(t.dtype == torch.bfloat16 for _, t in out)
    assert sum(gathered) == len(named) and 3 <= len(gathered) <= 6  # about four buckets, never the whole model
    assert counter["bytes"] == total_bytes
