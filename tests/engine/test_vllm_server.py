"""A real vLLM OpenAI server (a subprocess started as `trlx-scale serve` starts it) with the embedded model: sampling
groups, per-version LoRA adapters and full-weight reloads verified against the trainer's own log-probs, the rollout
producer on top of it, and the three faults (unreachable, another model, death mid-run) as errors, not hangs.

One server for the module (start-up ~30 s on 2 cores); the test that kills it runs last."""

from __future__ import annotations

import asyncio

import pytest
import torch

from trlx_scale.generation.cpu_environment import running_on_cpu_only
from trlx_scale.generation.server_client import (
    SamplingSettings,
    ServerFailedError,
    ServerModelMismatchError,
    ServerUnreachableError,
    VLLMServerClient,
    adapter_name,
)
from trlx_scale.generation.server_weights import write_adapter, write_full_weights
from trlx_scale.generation.vllm_server import ServerLaunch, VLLMServerProcess, free_port
from trlx_scale.rollout.async_producer import GroupRequest, RolloutProducer
from trlx_scale.rollout.staleness import StalenessSchedule

pytestmark = pytest.mark.slow

PROMPT = [2, 3, 20, 21, 13, 22, 29, 16, 4]  # token ids of the embedded tokenizer


@pytest.fixture(scope="module")
def server(default_model_dir):
    launch = ServerLaunch(model=default_model_dir, dtype="float32", max_model_len=256, max_loras=4, max_lora_rank=8)
    process = VLLMServerProcess(launch, startup_timeout=300).start()
    yield process
    process.stop()


def _client(server, default_model_dir, lora=False, **kwargs) -> VLLMServerClient:
    return VLLMServerClient(
        [server.url],
        model=default_model_dir,
        sampling=SamplingSettings(max_tokens=8),
        request_timeout=60,
        lora=lora,
        process=server,
        **kwargs,
    )


def _trainer_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids[1:])[:, None])[:, 0]


def _sample(client: VLLMServerClient, **request):
    return asyncio.run(_sample_and_close(client, GroupRequest(**{"prompt": PROMPT, "num_generations": 4, **request})))


async def _sample_and_close(client, request):
    try:
        return await client.sample(request)
    finally:
        await client.aclose()


def test_groups_are_sampled_seeded_and_scored_like_the_trainer(server, default_model_dir, default_model):
    client = _client(server, default_model_dir)
    client.check_model(default_model_dir)
    first = _sample(client, index=0, version=0, seed=11)
    again = _sample(client, index=0, version=0, seed=11)
    other = _sample(client, index=0, version=0, seed=12)
    assert len(first.completion_ids) == 4 and first.version == 0
    assert first.completion_ids == again.completion_ids and first.logprobs == again.logprobs
    assert first.completion_ids != other.completion_ids
    # The behaviour log-probs are the engine's of the sampled tokens (fp32 engine: ~1e-5 from the trainer's).
    for ids, logprobs in zip(first.completion_ids, first.logprobs, strict=True):
        expected = _trainer_logprobs(default_model, PROMPT + ids)[len(PROMPT) - 1 :]
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)


def _adapter(default_model_dir, path, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    write_adapter(model, path)
    return model


def test_each_version_is_an_adapter_of_its_own_verified_and_unloaded(server, default_model_dir, tmp_path):
    client = _client(server, default_model_dir, lora=True)
    models = {}
    for version in (0, 1):
        path = str(tmp_path / f"v{version}")
        models[version] = _adapter(default_model_dir, path, seed=version)
        client.load_adapter(version, path)
    listed = {entry["id"] for entry in client.served_models(server.url)}
    assert {adapter_name(0), adapter_name(1)} <= listed
    probe = PROMPT + [20, 21, 1]
    for version, model in models.items():  # each name answers with its own weights (the delivery check)
        served = torch.tensor(client.prompt_logprobs(probe, version)[0])
        assert torch.allclose(served, _trainer_logprobs(model, probe), atol=1e-4)
    assert not torch.allclose(
        torch.tensor(client.prompt_logprobs(probe, 0)[0]), torch.tensor(client.prompt_logprobs(probe, 1)[0])
    )
    sampled = _sample(client, index=0, version=1, seed=3)
    assert sampled.version == 1
    client.unload_adapter(0)
    assert adapter_name(0) not in {entry["id"] for entry in client.served_models(server.url)}
    with pytest.raises(ServerModelMismatchError, match="version 0's adapter is not loaded"):
        client.model_for(0)
    client.unload_adapter(1)


def test_full_weights_reload_from_files_and_is_verified(server, default_model_dir, default_model, tmp_path):
    client = _client(server, default_model_dir)
    probe = PROMPT + [20, 21, 1]
    with torch.no_grad():
        for parameter in default_model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    path = write_full_weights(default_model, str(tmp_path / "v1"))
    paused, total = client.reload_weights(1, path)
    assert 0 < paused <= total and client.full_weights_version == 1
    served = torch.tensor(client.prompt_logprobs(probe, 1)[0])
    assert torch.allclose(served, _trainer_logprobs(default_model, probe), atol=1e-4)
    assert _sample(client, index=0, version=1, seed=1).version == 1
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        client.reload_weights(2, str(tmp_path / "missing"))
    client.reload_weights(0, default_model_dir)  # the other tests' base weights back
    assert server.alive()


def test_the_producer_streams_groups_from_the_server_within_the_bound(server, default_model_dir, tmp_path):
    """Two steps ahead (max_staleness=2) with one adapter per version: every group is sampled by the version the
    schedule names, verified on the answer, in order."""
    client = _client(server, default_model_dir, lora=True)
    schedule = StalenessSchedule(groups_per_version=2, max_staleness=2)

    async def score(request, sampled):
        return [[float(len(ids))] for ids in sampled.completion_ids]

    producer = RolloutProducer(
        prompt_for=lambda index: PROMPT,
        sampler=client,
        score=score,
        schedule=schedule,
        num_generations=3,
        seed=0,
        max_inflight_tasks=8,
        queue_maxsize=16,
    )
    _adapter(default_model_dir, str(tmp_path / "v0"), seed=0)
    client.load_adapter(0, str(tmp_path / "v0"))
    producer.start()
    taken = []
    try:
        producer.publish_version(0)
        for step in range(4):
            taken += producer.take(2, timeout=60)
            _adapter(default_model_dir, str(tmp_path / f"v{step + 1}"), seed=step + 1)
            client.load_adapter(step + 1, str(tmp_path / f"v{step + 1}"))
            producer.publish_version(step + 1)
    finally:
        producer.close()
    assert [group.index for group in taken] == list(range(8))
    assert [group.sampled.version for group in taken] == [schedule.sampled_at(k) for k in range(8)]
    assert max(group.staleness for group in taken) == 2
    for version in list(client.loaded_adapters):
        client.unload_adapter(version)


def test_an_unreachable_server_is_an_error_at_once():
    client = VLLMServerClient([f"http://127.0.0.1:{free_port()}"], model="m", sampling=SamplingSettings(4))
    with pytest.raises(ServerUnreachableError, match="trlx-scale serve MODEL"):
        client.check_model("m")
    with pytest.raises(ServerUnreachableError):
        _sample(client, index=0, version=0, seed=0)


def test_a_server_of_another_model_is_refused(server, default_model_dir):
    with pytest.raises(ServerModelMismatchError, match="but this trainer trains 'Qwen/Qwen3-0.6B'"):
        _client(server, default_model_dir).check_model("Qwen/Qwen3-0.6B")
    wrong_name = VLLMServerClient([server.url], model="another-model", sampling=SamplingSettings(4))
    with pytest.raises(ServerModelMismatchError, match="does not serve the model"):
        _sample(wrong_name, index=0, version=0, seed=0)


def test_a_server_that_dies_mid_run_is_an_error_naming_its_exit(server, default_model_dir):
    """Last in the module: it kills the module's server while a long request is in flight."""
    client = _client(server, default_model_dir)
    client.sampling = SamplingSettings(max_tokens=200)

    async def sample_while_killed():
        request = GroupRequest(index=0, prompt=PROMPT, num_generations=64, version=0, seed=0)
        task = asyncio.create_task(client.sample(request))
        await asyncio.sleep(0.05)
        server.process.kill()  # the API server, as an OOM kill would
        try:
            return await task
        finally:
            await client.aclose()

    with pytest.raises(ServerFailedError, match="died: the server process exited"):
        asyncio.run(sample_while_killed())
    server.stop()  # its engine processes too


@pytest.mark.skipif(
    not running_on_cpu_only(), reason="the CPU engine's flags: on a GPU machine vLLM chunks prefills as it decides"
)
def test_on_cpu_the_server_prefills_whole_prompts():
    """vLLM 0.32's CPU sampler kills the engine on a seeded request whose prompt is split across prefill chunks
    (tests/test_compat.py); every request of the producer is seeded, so the server must not chunk (seen with tool
    trajectories: long held contexts beside other prompts)."""
    argv = ServerLaunch(model="m", port=8000, max_model_len=256).arguments()
    assert "--no-enable-chunked-prefill" in argv
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "4096"
    argv = ServerLaunch(model="m", port=8000).arguments()
    assert "--no-enable-chunked-prefill" in argv and "--max-num-batched-tokens" not in argv
