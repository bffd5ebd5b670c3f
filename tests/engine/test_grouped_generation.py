"""Group generation: runs of identical prompts collapsed to one request with n samples, rows restored in order."""

import pytest

from trlx_scale.generation.group_generation import collapse_runs, expand_outputs


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
