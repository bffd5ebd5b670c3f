"""vLLM's token-in/token-out endpoint (``/inference/v1/generate``): sampling requests whose every token names the
weights that sampled it.

Why this endpoint, and only for in-flight full-weight updates (``full_weight_reload="keep"``): there a reload pauses
the requests in flight where they are (``/pause?mode=keep``), loads the new weights and resumes them, so one
completion's tokens can come from two versions. vLLM 0.32 tracks that per request (the version string set by
``/update_weight_version`` at each engine step) and reports it on this endpoint only, as ``weight_versions``: spans
of output-token indexes, each with its version. ``/v1/completions`` drops it. The server must be started with
``--enable-scale-out`` (``ServerLaunch`` passes it); one without it answers 403, turned here into an error naming the
flag and the setting.

The versions are the rollout numbers the trainer sends (``str(version)``); a server no update has reached yet says
``"default"``: its start-up weights, version 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GENERATE_PATH = "/inference/v1/generate"
START_UP_VERSION = "default"  # what vLLM reports before the first /update_weight_version: the weights it loaded
SCALE_OUT_DISABLED = "Scale-out endpoints are disabled"  # vLLM 0.32's 403 text on a server without the flag


def generate_body(model: str, prompt_ids: list[int], *, n: int, seed: int, sampling: dict[str, Any]) -> dict:
    """One request: ``n`` samples of ``prompt_ids`` by ``model``, the sampled tokens' log-probs and their text."""
    return {
        "model": model,
        "token_ids": list(prompt_ids),
        "sampling_params": {"n": n, "seed": seed, "logprobs": 0, "detokenize": True, **sampling},
        "output_mode": "text",
    }


@dataclass
class GeneratedChoice:
    """One sample of an answer: its tokens, their log-probs, its text, why it stopped, and each token's version."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    token_versions: list[int]


def token_versions(spans: list[dict[str, Any]] | None, count: int) -> list[int]:
    """Each of ``count`` output tokens' version, from vLLM's spans (``[{"version", "start", "end"}]``, contiguous
    over the output). Missing or incomplete spans are an error: the batch would carry versions nobody reported."""
    if count == 0:
        return []
    if not spans:
        raise ValueError(f"the server reported no weight versions for {count} sampled tokens.")
    versions: list[int] = []
    for span in spans:
        if span["start"] != len(versions):
            raise ValueError(f"weight-version spans are not contiguous: {spans}.")
        label = span["version"]
        version = 0 if label == START_UP_VERSION else int(label)
        versions += [version] * (span["end"] - span["start"])
    if len(versions) != count:
        raise ValueError(f"weight-version spans cover {len(versions)} tokens of {count}: {spans}.")
    return versions


def read_choice(choice: dict[str, Any]) -> GeneratedChoice:
    """One choice of an answer in ``output_mode="text"`` (log-probs as ``{"content": [{"logprob": ...}]}``)."""
    ids = list(choice["token_ids"])
    logprobs = [entry["logprob"] for entry in (choice.get("logprobs") or {}).get("content") or []]
    if len(logprobs) != len(ids):
        raise ValueError(f"the server returned {len(logprobs)} log-probs for {len(ids)} sampled tokens.")
    return GeneratedChoice(
        index=int(choice["index"]),
        token_ids=ids,
        logprobs=logprobs,
        text=choice.get("text") or "",
        finish_reason=choice.get("finish_reason"),
        token_versions=token_versions(choice.get("weight_versions"), len(ids)),
    )
