"""The token-in/token-out endpoint's requests and answers (``generation/token_generate_endpoint.py``): each sampled
token's weight version from vLLM's spans, and what is refused rather than guessed."""

from __future__ import annotations

import httpx
import pytest

from trlx_scale.generation.server_client import SamplingSettings, ServerFailedError, VLLMServerClient
from trlx_scale.generation.token_generate_endpoint import generate_body, read_choice, token_versions


def test_spans_become_one_version_per_token():
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 5}]
    assert token_versions(spans, 5) == [0, 0, 3, 3, 3]
    assert token_versions(None, 0) == []


@pytest.mark.parametrize(
    ("spans", "count", "message"),
    [
        (None, 2, "reported no weight versions for 2 sampled tokens"),
        ([{"version": "1", "start": 1, "end": 3}], 3, "not contiguous"),
        ([{"version": "1", "start": 0, "end": 2}], 3, "cover 2 tokens of 3"),
    ],
)
def test_spans_that_do_not_cover_the_tokens_are_refused(spans, count, message):
    with pytest.raises(ValueError, match=message):
        token_versions(spans, count)


def test_a_choice_reads_ids_logprobs_text_and_versions():
    choice = {
        "index": 1,
        "token_ids": [7, 8],
        "text": "78",
        "finish_reason": "length",
        "logprobs": {"content": [{"token": "7", "logprob": -0.5}, {"token": "8", "logprob": -1.5}]},
        "weight_versions": [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 2}],
    }
    read = read_choice(choice)
    assert (read.index, read.token_ids, read.logprobs, read.text, read.finish_reason) == (
        1,
        [7, 8],
        [-0.5, -1.5],
        "78",
        "length",
    )
    assert read.token_versions == [2, 3]
    with pytest.raises(ValueError, match="1 log-probs for 2 sampled tokens"):
        read_choice({**choice, "logprobs": {"content": [{"logprob": -0.5}]}})


def test_the_request_asks_for_the_sampled_tokens_logprobs_and_text():
    body = generate_body("m", [1, 2], n=4, seed=9, sampling={"max_tokens": 5, "temperature": 1.0})
    assert body["token_ids"] == [1, 2] and body["output_mode"] == "text"
    assert body["sampling_params"] == {
        "n": 4,
        "seed": 9,
        "logprobs": 0,
        "detokenize": True,
        "max_tokens": 5,
        "temperature": 1.0,
    }


def test_a_server_without_the_endpoint_is_named_with_the_fix():
    client = VLLMServerClient(["http://127.0.0.1:1"], model="m", sampling=SamplingSettings(4))
    refused = httpx.Response(403, text='{"error": "Scale-out endpoints are disabled. Restart vllm serve ..."}')
    with pytest.raises(ServerFailedError, match="--enable-scale-out .*full_weight_reload='drain'"):
        client._check_status("http://127.0.0.1:1", refused, "group 0")


def test_adapters_never_keep_requests_through_a_reload():
    client = VLLMServerClient(
        ["http://x"], model="m", sampling=SamplingSettings(4), lora=True, keep_requests_on_reload=True
    )
    assert not client.keep_requests_on_reload  # adapter updates never pause the servers
