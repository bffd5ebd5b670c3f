"""Engine components without an engine: lifecycle order, group collapsing, sync-mode choice, bucketed streaming."""

from contextlib import contextmanager

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trlx_scale.generation.group_generation import collapse_runs, expand_outputs
from trlx_scale.generation.lifecycle import EngineLifecycle, EngineState, LifecycleError
from trlx_scale.generation.weight_sync import (
    choose_sync_mode,
    full_weight_stream,
    lora_ineligibility,
    vllm_max_lora_rank,
)
from trlx_scale.optim.optimizer_offload import OptimizerStateOffloader


class FakeEngine:
    def __init__(self):
        self.calls = []

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def _round(lifecycle):
    lifecycle.wake_weights()
    lifecycle.wake_kv_cache()
    lifecycle.begin_generation()
    lifecycle.end_generation(sleep=True)


def test_lifecycle_runs_the_documented_order():
    engine = FakeEngine()
    lifecycle = EngineLifecycle(engine, sleep_level=1, enabled=True, start_asleep=True)
    _round(lifecycle)
    assert engine.calls == [
        ("wake_up", ("weights",)),
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),
        ("sleep", 1),
    ]
    assert lifecycle.state is EngineState.ASLEEP and not lifecycle.weights_discarded
    assert set(lifecycle.timings) == {"wake_weights", "wake_kv_cache", "sleep"}


def test_lifecycle_rejects_out_of_order_calls():
    lifecycle = EngineLifecycle(FakeEngine(), sleep_level=2, enabled=True, start_asleep=True)
    assert lifecycle.weights_discarded
    with pytest.raises(LifecycleError, match="cannot wake the KV cache while the engine is asleep"):
        lifecycle.wake_kv_cache()
    with pytest.raises(LifecycleError, match="cannot generate while the engine is asleep"):
        lifecycle.begin_generation()
    with pytest.raises(ValueError, match="sleep_level must be one of"):
        EngineLifecycle(FakeEngine(), sleep_level=3, enabled=True)


def test_lifecycle_without_sleep_mode_skips_vllm_calls_but_not_the_order():
    """CPU: same transitions, no sleep/wake calls; the prefix cache is still reset after every sync."""
    engine = FakeEngine()
    lifecycle = EngineLifecycle(engine, sleep_level=2, enabled=False, start_asleep=True)
    _round(lifecycle)
    assert engine.calls == [("reset_prefix_cache",)]
    assert lifecycle.transitions == ["wake_weights", "wake_kv_cache", "reset_prefix_cache", "sleep"]


def test_lifecycle_of_an_engine_that_never_sleeps():
    engine = FakeEngine()
    lifecycle = EngineLifecycle(engine, sleep_level=1, enabled=False, start_asleep=False)
    lifecycle.wake_weights()  # no-op: awake
    lifecycle.wake_kv_cache()
    lifecycle.begin_generation()
    lifecycle.end_generation(sleep=False)
    assert lifecycle.state is EngineState.AWAKE and engine.calls == [("reset_prefix_cache",)]


def test_collapse_runs_and_expand_keep_row_order():
    prompts = [[1, 2], [1, 2], [1, 2], [3], [3], [1, 2]]  # last row: same prompt, new group
    runs = collapse_runs(prompts)
    assert runs == [(0, 3), (3, 2), (5, 1)]
    outputs = [["a0", "a1", "a2"], ["b0", "b1"], ["c0"]]
    assert expand_outputs(runs, outputs) == ["a0", "a1", "a2", "b0", "b1", "c0"]
    with pytest.raises(ValueError, match="asked for 2 samples, vLLM returned 1"):
        expand_outputs(runs, [["a0", "a1", "a2"], ["b0"], ["c0"]])
    # Same tokens but different images are different requests.
    assert collapse_runs([[1], [1]], extras=["img-a", "img-b"]) == [(0, 1), (1, 1)]


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


def test_optimizer_offload_moves_nothing_when_states_are_already_on_the_host():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(3)
    optimizer.step()
    state_before = {k: v for k, v in optimizer.state[param].items()}
    offloader = OptimizerStateOffloader(optimizer)
    assert offloader.offload() == 0 and offloader.reload() == 0
    assert all(optimizer.state[param][k] is v for k, v in state_before.items())


def test_grouped_llm_sends_each_group_once_and_returns_trl_rows_in_order():
    """TRL's generate hands over one row per completion (n=1); each run of identical prompts reaches vLLM once with
    n = its length and the synced adapter, and TRL gets its rows back in order, one completion each."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    from trlx_scale.generation.grouped_llm import GroupedLLM

    calls = []

    class FakeEngine:
        llm_engine = "the real engine's attribute"

        def generate(self, requests, sampling_params, lora_request, use_tqdm):
            calls.append(([r["prompt_token_ids"] for r in requests], [p.n for p in sampling_params], lora_request))
            return [
                SimpleNamespace(
                    prompt_token_ids=r["prompt_token_ids"],
                    outputs=[SimpleNamespace(token_ids=[r["prompt_token_ids"][0], i]) for i in range(p.n)],
                )
                for r, p in zip(requests, sampling_params, strict=True)
            ]

    llm = GroupedLLM(FakeEngine())
    llm.lora_request = "adapter"
    rows = [{"prompt_token_ids": p} for p in ([7], [7], [7], [8], [8], [7])]
    params = SamplingParams(n=1, max_tokens=2)
    out = llm.generate(rows, sampling_params=params, use_tqdm=False)
    assert calls == [([[7], [8], [7]], [3, 2, 1], "adapter")]
    assert [row.prompt_token_ids for row in out] == [[7], [7], [7], [8], [8], [7]]
    assert [row.outputs[0].token_ids for row in out] == [[7, 0], [7, 1], [7, 2], [8, 0], [8, 1], [7, 0]]
    assert params.n == 1  # TRL's parameters are left as they were
    assert llm.last_unique_prompts == 3 and llm.llm_engine == "the real engine's attribute"
    assert llm.wake_up(tags=["kv_cache"]) is None and llm.sleep(level=2) is None  # the lifecycle owns these
