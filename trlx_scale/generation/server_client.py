"""The client of one or more vLLM OpenAI servers: sampling groups, loading weights, and clear errors.

Sampling (``sample``, a ``GroupSampler`` of the rollout producer): one ``/v1/completions`` request per group, the
prompt as token ids sent once with ``n`` = the group size, the request's seed, ``logprobs: 0`` (the sampled tokens'
log-probs) and ``return_token_ids``. With several servers (data-parallel replicas) group ``k`` goes to replica
``k mod replicas``: balanced, and the same replica whatever the timing. Every weight update goes to every replica.

Which weights answer is part of the request, and checked on the answer:

- LoRA: each policy version is an adapter of its own name (``adapter_name(v)``: vLLM's prefix cache is keyed on the
  name, so a new version never reuses an old one's cached prompt states), loaded from its files at run time and
  unloaded when no sample can still use it. The request names the version's adapter; the answer must name it too.
  (Never a base-model request beside LoRA ones: on vLLM 0.32's CPU LoRA kernels the base requests of a mixed batch
  get the last adapter's outputs, since "no adapter" is index -1.)
- Full weights: the server reloads the version's files (``reload_weights``: pause, ``reload_weights`` through
  ``/collective_rpc``, reset the prefix cache, resume). Requests in flight either finish on the old weights first
  (``keep_requests_on_reload=False``: ``/pause?mode=wait``, and the trainer reloads inside a hold of the client's
  ``RequestGate``, which every sampling request passes, so the version recorded at sending is the one that answers),
  or stay where they are (``True``: ``/pause?mode=keep``; the reload resets their KV cache, so their next tokens are
  the new weights' on their whole context, and they continue). Then every token names the version that sampled it:
  requests go to the token-in/token-out endpoint (``token_generate_endpoint``), whose answers carry vLLM's
  per-token weight versions, and the version of a group is its oldest token's.

Faults are errors within ``request_timeout`` seconds, never a hang: an unreachable server
(``ServerUnreachableError``), a server that serves another model (``ServerModelMismatchError``), a server that dies
or fails mid-run (``ServerFailedError``, with the exit code and the end of the log when this process started it).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from transformers.utils import logging

from ..compat.vllm_checked_reload import CHECKED_RELOAD_METHOD
from ..rollout.async_producer import GroupRequest, SampledGroup
from ..rollout.request_gate import RequestGate
from ..weight_fingerprints import FINGERPRINTS_FILE, mismatched
from .token_generate_endpoint import GENERATE_PATH, SCALE_OUT_DISABLED, generate_body, read_choice
from .vllm_server import VLLMServerProcess

logger = logging.get_logger(__name__)

TRANSPORT_RETRIES = 2  # a sampling request resent after a dropped keep-alive connection, at most this often


class ServerError(RuntimeError):
    """A vLLM server could not do what the trainer asked."""


class ServerUnreachableError(ServerError):
    """Nothing answers at the server's URL."""


class ServerModelMismatchError(ServerError):
    """The server answers, but serves another model (or not the adapter asked for)."""


class PartialDeliveryError(ServerError):
    """A full-weight reload left some of the server's parameters on their old weights."""


class ServerFailedError(ServerError):
    """The server died, closed a connection mid-request, or answered with an error."""


def adapter_name(version: int) -> str:
    """The name policy version ``version``'s LoRA adapter is served under."""
    return f"trlx-scale-policy-v{version}"


@dataclass
class SamplingSettings:
    """The sampling fields of a completion request (TRL's GRPO fields of the same names)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def body(self) -> dict[str, Any]:
        body = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p}
        if self.top_k and self.top_k > 0:
            body["top_k"] = self.top_k
        if self.min_p:
            body["min_p"] = self.min_p
        if self.repetition_penalty != 1.0:
            body["repetition_penalty"] = self.repetition_penalty
        return body


def default_prompt_ids(prompt: Any) -> list[int]:
    """The token ids of a producer prompt: the prompt itself, or its ``prompt_ids`` entry."""
    return list(prompt["prompt_ids"] if isinstance(prompt, dict) else prompt)


class VLLMServerClient:
    """See the module docstring. ``model``: the base model's served name (``--served-model-name``, else its path).
    ``process``: the server this trainer started, if it did (its exit is then reported in errors)."""

    def __init__(
        self,
        base_urls: Sequence[str],
        model: str,
        sampling: SamplingSettings,
        request_timeout: float = 600.0,
        lora: bool = False,
        process: VLLMServerProcess | None = None,
        prompt_ids: Callable[[Any], list[int]] = default_prompt_ids,
        keep_requests_on_reload: bool = False,
    ):
        if not base_urls:
            raise ValueError("vllm_server_base_url: give at least one server URL.")
        self.base_urls = [url.rstrip("/") for url in base_urls]
        self.model = model
        self.sampling = sampling
        self.request_timeout = request_timeout
        self.lora = lora
        self.process = process
        self.prompt_ids = prompt_ids
        # Full weights only (adapters never pause the servers): see the module docstring.
        self.keep_requests_on_reload = keep_requests_on_reload and not lora
        self.full_weights_version: int = 0  # the base weights the servers started with are version 0
        self.loaded_adapters: dict[int, str] = {}
        # Every sampling request passes it: a full-weight reload holds it (``RolloutProducer.hold_requests``), so
        # the version read when a request is sent is the version that answers it.
        self.gate = RequestGate()
        self._async_client: httpx.AsyncClient | None = None
        # Made once: without it httpx builds a TLS context per request, reading the CA bundle each time (about
        # 20 ms, against 1-2 ms for the request itself on localhost); a full-weight update makes five requests.
        self._tls = httpx.create_ssl_context()
        self._checked_reload = True  # until a server turns out to lack the extension (_reload_from_files)

    # ---------------------------------------------------------------- errors
    def _server_alive(self) -> bool:
        """False when this process started the server and it has exited (or is exiting: a short wait)."""
        return self.process is None or not self.process.wait_for_exit(1.0)

    def _failure(self, url: str, error: Exception) -> ServerError:
        if self.process is not None and not isinstance(error, httpx.TimeoutException):
            self.process.wait_for_exit(2.0)  # a dropped connection: the process may be exiting right now
        dead = self.process is not None and not self.process.alive()
        if dead:
            return ServerFailedError(f"the vLLM server at {url} died: {self.process.exit_report()}")
        if isinstance(error, httpx.ConnectError):
            return ServerUnreachableError(
                f"no vLLM server answers at {url} ({error}). Start one with `trlx-scale serve MODEL` and pass its URL "
                "as vllm_server_base_url, or leave vllm_server_base_url unset and the trainer starts one."
            )
        if isinstance(error, httpx.TimeoutException):
            return ServerFailedError(
                f"the vLLM server at {url} did not answer within request_timeout={self.request_timeout:.0f} s "
                f"({type(error).__name__}). Check the server, or raise request_timeout."
            )
        return ServerFailedError(f"the vLLM server at {url} failed mid-request: {type(error).__name__}: {error}")

    def _check_status(self, url: str, response: httpx.Response, what: str) -> None:
        if response.status_code == 200:
            return
        text = response.text[:500]
        if response.status_code == 403 and SCALE_OUT_DISABLED in text:
            raise ServerFailedError(
                f"the vLLM server at {url} has no token-in/token-out endpoint ({GENERATE_PATH}), which "
                "full_weight_reload='keep' samples through (it reports which weights sampled each token). Start "
                "the server with --enable-scale-out (`trlx-scale serve` does), or set full_weight_reload='drain'."
            )
        if response.status_code == 404 and "does not exist" in text:
            raise ServerModelMismatchError(
                f"the vLLM server at {url} does not serve the model {what} asks for: {text}. Point "
                "vllm_server_base_url at a server started for this model (`trlx-scale serve MODEL`)."
            )
        raise ServerFailedError(f"the vLLM server at {url} answered {what} with HTTP {response.status_code}: {text}")

    def _request(self, method: str, url: str, path: str, what: str, **kwargs: Any) -> httpx.Response:
        try:
            response = httpx.request(method, url + path, timeout=self.request_timeout, verify=self._tls, **kwargs)
        except httpx.HTTPError as error:
            raise self._failure(url, error) from error
        self._check_status(url, response, what)
        return response

    # ---------------------------------------------------------------- the served model
    def served_models(self, url: str) -> list[dict[str, Any]]:
        return self._request("GET", url, "/v1/models", "the model list").json()["data"]

    def check_model(self, expected: str) -> None:
        """Every server serves ``expected`` (a path or a Hub id) as its base model, under ``self.model``."""
        for url in self.base_urls:
            base = [entry for entry in self.served_models(url) if entry.get("parent") is None]
            names = {entry["id"] for entry in base} | {entry.get("root") for entry in base}
            if self.model not in names or not ({expected, os.path.abspath(expected)} & names):
                raise ServerModelMismatchError(
                    f"the vLLM server at {url} serves {sorted(n for n in names if n)}, but this trainer trains "
                    f"{expected!r} (served as {self.model!r}). Start the server for this model, "
                    f"`trlx-scale serve {expected}`, or point vllm_server_base_url at one that serves it."
                )

    # ---------------------------------------------------------------- sampling
    def model_for(self, version: int) -> str:
        """The served name that answers for ``version``."""
        if not self.lora:
            return self.model
        if version not in self.loaded_adapters:
            raise ServerModelMismatchError(
                f"policy version {version}'s adapter is not loaded on the servers (loaded: "
                f"{sorted(self.loaded_adapters)})."
            )
        return self.loaded_adapters[version]

    async def sample(self, request: GroupRequest) -> SampledGroup:
        """One group: ``request.num_generations`` completions of the prompt by ``request.version``."""
        url = self.base_urls[request.index % len(self.base_urls)]
        prompt_ids = self.prompt_ids(request.prompt)
        if self.keep_requests_on_reload:
            return await self._sample_versioned(url, request, prompt_ids)
        async with self.gate.request():
            if self.lora:
                name, version = self.model_for(request.version), request.version
            else:
                name, version = self.model, self.full_weights_version
            body = {
                "model": name,
                "prompt": prompt_ids,
                "n": request.num_generations,
                "seed": request.seed,
                "logprobs": 0,
                "return_token_ids": True,
                **self.sampling.body(),
            }
            answer = await self._post_completion(url, body, f"group {request.index}")
        if answer.get("model") != name:
            raise ServerModelMismatchError(
                f"group {request.index}: asked {url} for {name!r}, the answer came from {answer.get('model')!r}."
            )
        choices = sorted(answer["choices"], key=lambda choice: choice["index"])
        return SampledGroup(
            completion_ids=[list(choice["token_ids"]) for choice in choices],
            logprobs=[list(choice["logprobs"]["token_logprobs"]) for choice in choices],
            completions=[choice["text"] for choice in choices],
            version=version,
            prompt_ids=prompt_ids,
        )

    async def _sample_versioned(self, url: str, request: GroupRequest, prompt_ids: list[int]) -> SampledGroup:
        """A group whose requests a reload keeps in flight: each token's version from the server; the group's
        version is its oldest token's (the staleness it is admitted and trained with), and a group that sampled no
        token has the version the servers held when it was sent."""
        sent_at = self.full_weights_version
        body = generate_body(
            self.model, prompt_ids, n=request.num_generations, seed=request.seed, sampling=self.sampling.body()
        )
        # Counted by the gate although no reload holds it: the probe's hold (vLLM's CPU build, a LoRA-enabled
        # engine: compat.vllm_cpu_lora_scoring) must wait for it, or the probe is batched with it and kills the engine.
        async with self.gate.request():
            answer = await self._post_completion(url, body, f"group {request.index}", path=GENERATE_PATH)
        choices = sorted((read_choice(choice) for choice in answer["choices"]), key=lambda choice: choice.index)
        versions = [choice.token_versions for choice in choices]
        return SampledGroup(
            completion_ids=[choice.token_ids for choice in choices],
            logprobs=[choice.logprobs for choice in choices],
            completions=[choice.text for choice in choices],
            version=min((min(v) for v in versions if v), default=sent_at),
            prompt_ids=prompt_ids,
            token_versions=versions,
        )

    async def sample_turn(
        self, prompt_ids: list[int], max_tokens: int, seed: int, *, version: int, replica: int
    ) -> tuple[list[int], list[float], str, int, list[int] | None]:
        """One later turn of a multi-turn trajectory: ``prompt_ids`` are the trajectory's held ids (token-in), on
        replica ``replica`` (the one that sampled its first turn: its prefix is cached there). Returns the sampled
        ids with their log-probs (token-out; the end token included: it is trained), ``"length"`` or ``"stop"``, the
        policy version that sampled them, and each token's version where a reload can land inside the turn
        (``keep_requests_on_reload``; else None).

        With adapters that is ``version`` (the trajectory's first turn's: its adapter stays loaded while a group in
        flight can use it). With full weights it is the version the servers hold when the turn is sent, ``version``
        or a newer one: a reload waits for requests at the servers, not for trajectories waiting on their tools
        (``RequestGate``), so a trajectory's turns after a reload are sampled by the new weights, and each turn's
        log-probs are those of the weights that sampled it."""
        url = self.base_urls[replica % len(self.base_urls)]
        if self.keep_requests_on_reload:
            sampling = {key: value for key, value in self.sampling.body().items() if key != "max_tokens"}
            body = generate_body(
                self.model, prompt_ids, n=1, seed=seed, sampling={**sampling, "max_tokens": max_tokens}
            )
            async with self.gate.request():  # counted for the probe's hold, as a group's request (above)
                answer = await self._post_completion(url, body, "a trajectory's turn", path=GENERATE_PATH)
            choice = read_choice(answer["choices"][0])
            finish = "length" if choice.finish_reason == "length" else "stop"
            # The turn's oldest token's version: a turn a reload cut through counts as the older weights'.
            served = min(choice.token_versions, default=self.full_weights_version)
            if served < version:
                raise RuntimeError(
                    f"a trajectory started on version {version} continued on version {served}: versions went "
                    "backwards."
                )
            return choice.token_ids, choice.logprobs, finish, served, choice.token_versions
        async with self.gate.request():
            if self.lora:
                name, served = self.model_for(version), version
            elif self.full_weights_version < version:
                raise RuntimeError(
                    f"a trajectory started on version {version} continues while the servers hold the older version "
                    f"{self.full_weights_version}: versions went backwards."
                )
            else:
                name, served = self.model, self.full_weights_version
            body = {
                "model": name,
                "prompt": list(prompt_ids),
                "max_tokens": max_tokens,
                "seed": seed,
                "logprobs": 0,
                "return_token_ids": True,
                **{key: value for key, value in self.sampling.body().items() if key != "max_tokens"},
            }
            answer = await self._post_completion(url, body, "a trajectory's turn")
        if answer.get("model") != name:
            raise ServerModelMismatchError(f"asked {url} for {name!r}, the answer came from {answer.get('model')!r}.")
        choice = answer["choices"][0]
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"]), finish, served, None

    async def _post_completion(
        self, url: str, body: dict[str, Any], what: str, path: str = "/v1/completions"
    ) -> dict[str, Any]:
        """``/v1/completions`` (or ``path``) on the producer's event loop, a dropped keep-alive connection
        retried."""
        if self._async_client is None:  # made on the producer's event loop, which it then belongs to
            self._async_client = httpx.AsyncClient(timeout=self.request_timeout, verify=self._tls)
        for attempt in range(TRANSPORT_RETRIES + 1):
            try:
                response = await self._async_client.post(url + path, json=body)
                break
            except httpx.HTTPError as error:
                # A keep-alive connection the server closed as the request went out (uvicorn drops idle ones after
                # 5 s) fails with a read/protocol error although the server is fine: a seeded request is safe to
                # send again. A server that is gone, a timeout, or repeated failures are errors.
                transient = isinstance(error, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError))
                if not transient or attempt == TRANSPORT_RETRIES or not self._server_alive():
                    raise self._failure(url, error) from error
                await asyncio.sleep(0.1 * (attempt + 1))
        self._check_status(url, response, what)
        return response.json()

    def prompt_logprobs(self, token_ids: list[int], version: int) -> list[list[float]]:
        """Each server's log-probs of ``token_ids[1:]`` given what precedes, by ``version``'s weights: the probe
        that checks a weight update arrived (compared with the trainer's own log-probs of the same tokens)."""
        body = {
            "model": self.model_for(version) if self.lora else self.model,
            "prompt": token_ids,
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "temperature": 1.0,
        }
        results = []
        for url in self.base_urls:
            answer = self._request("POST", url, "/v1/completions", "the probe", json=body).json()
            scored = answer["choices"][0]["prompt_logprobs"][1:]
            results.append([entry[str(token)]["logprob"] for entry, token in zip(scored, token_ids[1:], strict=True)])
        return results

    # ---------------------------------------------------------------- weight updates
    def load_adapter(self, version: int, path: str) -> float:
        """Load ``version``'s adapter (saved at ``path``) on every server under its own name, and check that each
        lists it from that path. Returns the seconds it took."""
        began = time.monotonic()
        name = adapter_name(version)
        for url in self.base_urls:
            self._request(
                "POST", url, "/v1/load_lora_adapter", "the adapter load", json={"lora_name": name, "lora_path": path}
            )
            listed = {entry["id"]: entry.get("root") for entry in self.served_models(url)}
            if listed.get(name) != path:
                raise ServerModelMismatchError(
                    f"the vLLM server at {url} was asked to load {name} from {path} but lists {listed.get(name)!r}."
                )
        self.loaded_adapters[version] = name
        return time.monotonic() - began

    def record_update(self, version: int) -> None:
        """Another process (the main one) sent ``version`` to the servers: this client asks for it from now on."""
        if self.lora:
            self.loaded_adapters[version] = adapter_name(version)
        else:
            self.full_weights_version = version

    def unload_adapter(self, version: int) -> None:
        name = self.loaded_adapters.pop(version)
        for url in self.base_urls:
            self._request("POST", url, "/v1/unload_lora_adapter", "the adapter unload", json={"lora_name": name})

    def reload_weights(self, version: int, path: str) -> tuple[float, float]:
        """Every server reloads its weights from the checkpoint files at ``path`` (version ``version``). Returns the
        seconds the servers were paused (the longest) and the seconds it took in all. The files must name every
        weight vLLM holds: a layer missing from them keeps its old weights (a transformers checkpoint with tied
        embeddings omits ``lm_head``; ``server_weights.write_full_weights`` names it)."""
        if not os.path.isdir(path) or not any(name.endswith(".safetensors") for name in os.listdir(path)):
            # vLLM 0.32 answers a bad path with an error but leaves its weights unloaded, and dies at the next request.
            raise FileNotFoundError(f"no safetensors weights in {path}: not sent to the server.")
        began, paused = time.monotonic(), 0.0
        keep = self.keep_requests_on_reload
        for url in self.base_urls:
            self._request("POST", url, "/pause", "the pause", params={"mode": "keep" if keep else "wait"})
            pause_began = time.monotonic()
            try:
                self._reload_from_files(url, path)
                if keep:
                    # Tokens from here on are the new version's; the requests kept in flight give up their KV
                    # cache (computed by the old weights) and recompute it with the new ones when they resume.
                    self._request(
                        "POST", url, "/update_weight_version", "the weight version", json={"new_version": str(version)}
                    )
                reset = self._request(
                    "POST",
                    url,
                    "/reset_prefix_cache",
                    "the prefix-cache reset",
                    params={"reset_running_requests": "true"} if keep else None,
                )
                if keep and not reset.json().get("success", False):
                    raise ServerFailedError(
                        f"the vLLM server at {url} did not reset its prefix cache after loading version {version}: "
                        "later requests would reuse states the old weights computed."
                    )
            finally:
                self._request("POST", url, "/resume", "the resume")
            paused = max(paused, time.monotonic() - pause_began)
        self.full_weights_version = version
        return paused, time.monotonic() - began

    def _reload_from_files(self, url: str, path: str) -> None:
        """One server's reload, checked where the server has trlx_scale's worker extension (servers the trainer or
        ``trlx-scale serve`` started: ``compat.vllm_checked_reload``): a delivery that left any parameter on its old
        weights raises ``PartialDeliveryError`` naming them. A server without it reloads unchecked (said once)."""
        if self._checked_reload:
            try:
                response = httpx.request(
                    "POST",
                    url + "/collective_rpc",
                    json={"method": CHECKED_RELOAD_METHOD, "kwargs": {"weights_path": path}},
                    timeout=self.request_timeout,
                    verify=self._tls,
                )
            except httpx.HTTPError as error:
                raise self._failure(url, error) from error
            if response.status_code != 200 and CHECKED_RELOAD_METHOD in response.text:
                self._checked_reload = False  # a server started without the extension: no such method
                logger.warning(
                    "The vLLM server at %s has no %s (it was not started by trlx_scale): full-weight reloads are "
                    "not checked for parameters left on their old weights. Start it with `trlx-scale serve`.",
                    url,
                    CHECKED_RELOAD_METHOD,
                )
            else:
                self._check_status(url, response, "the weight reload")
                for worker in response.json().get("results", []):
                    missing = worker["not_loaded"]
                    if missing:
                        raise PartialDeliveryError(
                            f"the vLLM server at {url} kept {len(missing)} of its {worker['parameters']} parameters "
                            f"on their old weights after loading {path} (no tensor of the files reached them): "
                            f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}. The files must hold "
                            "every weight the server's model has."
                        )
                    self._check_fingerprints(url, path, worker.get("fingerprints"))
                return
        self._request(
            "POST",
            url,
            "/collective_rpc",
            "the weight reload",
            json={"method": "reload_weights", "kwargs": {"weights_path": path}},
        )

    @staticmethod
    def _check_fingerprints(url: str, path: str, loaded: dict | None) -> None:
        """The tensors a server's reload read against the fingerprints written beside them
        (``weight_fingerprints``): one that arrived with other values (a damaged or replaced file) is named."""
        written = os.path.join(path, FINGERPRINTS_FILE)
        if loaded is None or not os.path.isfile(written):  # an older extension, or files written elsewhere
            return
        with open(written) as handle:
            sent = json.load(handle)
        problems = mismatched(sent, loaded)
        if problems:
            raise PartialDeliveryError(
                f"the vLLM server at {url} read {len(problems)} of the {len(sent)} tensors of {path} with other "
                f"values than the trainer wrote: {', '.join(problems[:5])}{', ...' if len(problems) > 5 else ''}. "
                "The files were changed after they were written (or another version's files are at that path); "
                "stopping rather than training on weights nobody sent."
            )

    async def aclose(self) -> None:
        if self._async_client is not None:
            await self._async_client.aclose()
            self._async_client = None
