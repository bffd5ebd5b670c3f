"""A test helper: a ``TurnSampler`` on vLLM servers (the trainers sample on servers through
``trlx_scale.agents.server_tool_sampler`` and ``server_gym_sampler``; this bare one checks the token-in/token-out
contract of ``run_trajectories`` against a real server): each turn continues the trajectory's held token ids (token-in) and returns the
sampled ids with their log-probs (token-out), through ``/v1/completions`` with a token-id prompt.

Turns of one trajectory go to one replica (chosen by the trajectory's seed), so the server's prefix cache holds its
growing context; the trajectories of a batch are spread over the replicas. Each turn is seeded from the trajectory's
seed and the turn's number, so a trajectory's samples do not depend on what else the server was doing.
Requests run concurrently on the caller's event loop: the server's continuous batching takes whichever turns are
ready, so no trajectory waits for another's tools.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from trlx_scale.agents.multi_turn_rollout import SampledTurn
from trlx_scale.generation.rollout_seeds import turn_seed


class ServerTurnSampler:
    """Samples turns on the vLLM servers at ``base_urls`` serving ``model`` (see the module docstring). ``model`` is
    the name requests ask for: the base model, or a policy version's adapter (``server_client.adapter_name``) when
    the trainer syncs adapters. A standalone sampler (``run_trajectories``' building block); ``AsyncGRPOTrainer``
    samples its later turns through ``VLLMServerClient.sample_turn`` instead (``server_tool_sampler``), which shares
    the client's retries, TLS context and version names."""

    def __init__(
        self,
        base_urls: Sequence[str],
        model: str,
        temperature: float = 1.0,
        request_timeout: float = 600.0,
        stop_token_ids: Sequence[int] | None = None,
    ):
        if not base_urls:
            raise ValueError("give at least one server URL.")
        self.base_urls = [url.rstrip("/") for url in base_urls]
        self.model = model
        self.temperature = temperature
        self.request_timeout = request_timeout
        self.stop_token_ids = list(stop_token_ids or [])
        self._client: httpx.AsyncClient | None = None  # made on the loop that samples (httpx clients belong to one)

    def replica_for(self, seed: int) -> str:
        return self.base_urls[seed % len(self.base_urls)]

    async def sample(self, prompt_ids: list[int], max_tokens: int, seed: int, turn: int) -> SampledTurn:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.request_timeout)
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "seed": turn_seed(seed, turn),
            "logprobs": 0,
            "return_token_ids": True,
            # The end-of-turn token is part of the turn: sampled, returned and trained (not stripped as a stop).
            "skip_special_tokens": False,
        }
        if self.stop_token_ids:
            body["stop_token_ids"] = self.stop_token_ids
        url = self.replica_for(seed)
        response = await self._client.post(url + "/v1/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"the vLLM server at {url} refused a turn ({response.status_code}): {response.text}")
        choice = response.json()["choices"][0]
        return SampledTurn(
            ids=list(choice["token_ids"]),
            logprobs=list(choice["logprobs"]["token_logprobs"]),
            finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
        )

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
