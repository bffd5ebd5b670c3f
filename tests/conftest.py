"""Shared fixtures: the embedded model (shipped, HF format) and one vLLM CPU engine for the whole session."""

from __future__ import annotations

import os

# vLLM reads these when an engine starts: a small KV cache (unset, it reserves most of the RAM) and the engine core in
# this process, so tests can reach the model runner the way a colocated trainer does.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No telemetry from the suite (TRL reports every trainer it builds, vLLM its engines): a test machine has no route to
# the Hub, and each report is a DNS lookup and a connection attempt, from this process and every one it launches.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
# vLLM's sampler wraps one helper in torch.compile (logprobs.batched_count_greater_than, the sampled token's rank):
# every process that generates with log-probs pays 2-3.5 s for it at its first generation on CPU, even with the compiled
# code cached (torch's vector-ISA probes and the cache key): 46 minutes of tests became 38 on a fresh clone. The helper
# counts integers, so eager gives the same values. Only the processes the suite launches run without torch.compile:
# torch reads the variable when torch._dynamo.config is first imported, so this process reads it first and keeps
# compiling (its own tests use what needs it: flex_attention on CPU). The runs that check a user's path exactly (the
# README's main job, the installed wheel) take it out again: helpers.launch.SUITE_ONLY_VARIABLES.
import torch._dynamo.config  # noqa: E402, F401

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from trlx_scale.tasks.default_model import default_model_path  # noqa: E402


@pytest.fixture(autouse=True)
def _environment_of_the_test():
    """Each test gets the environment it started with. A colocated engine exports RANK/WORLD_SIZE/MASTER_PORT for
    vLLM's launcher; left behind, a later plain config would join a process group on that port (and fail with
    EADDRINUSE when another job holds it)."""
    saved = dict(os.environ)
    yield
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    os.environ.update(saved)


@pytest.fixture()
def fake_hub(monkeypatch):
    """A local fake Hub (tests/helpers/fake_hub.py) that HF_ENDPOINT points at, with a token in HF_TOKEN."""
    from .helpers.fake_hub import FakeHub

    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_fake_token")
        yield hub


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def grpo_example_three_steps(tmp_path_factory):
    """examples/grpo.py for 3 steps in 1 process through `accelerate launch`, with the example's defaults and 40
    held-out prompts: (output directory, what it printed). Every test that reads such a run (the example's saved
    files and summary, the planner against the measured peak) reads this one instead of launching its own."""
    from .helpers.launch import ACCELERATE_LAUNCH, REPO_ROOT, run_command

    out = tmp_path_factory.mktemp("grpo_example_three_steps")
    single = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    example = os.path.join(REPO_ROOT, "examples", "grpo.py")
    arguments = [example, "--max_steps", "3", "--eval_size", "40", "--output_dir", str(out)]
    return out, run_command([*ACCELERATE_LAUNCH, *single, *arguments], timeout=800).stdout


@pytest.fixture()
def default_model(default_model_dir):
    """A fresh fp32 copy of the default model for each test (tests may change its weights)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def _engine_cache():
    return {}


@pytest.fixture()
def vllm_engine(default_model_dir, _engine_cache):
    """One real vLLM CPU engine on the default model, fp32, shared by every test that only needs an engine.

    vLLM keeps its parallel groups in process globals, and a trainer's engine tears them down when it is freed; the
    shared engine is then rebuilt once (about 5 s) instead of failing. Tests that change its weights must restore them
    (see ``restore_engine_weights``).
    """
    from vllm import LLM
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    from trlx_scale.compat.vllm_engine_finalizers import finalize_dropped_engines

    if "llm" not in _engine_cache or not model_parallel_is_initialized():
        _engine_cache.pop("llm", None)
        finalize_dropped_engines()  # a dropped trainer's engine must not reset the groups inside this start-up
        _engine_cache["llm"] = LLM(
            model=default_model_dir,
            dtype="float32",
            enforce_eager=True,
            max_model_len=64,
            max_num_seqs=64,
            seed=0,
            enable_prefix_caching=True,
        )
    return _engine_cache["llm"]


@pytest.fixture()
def restore_engine_weights(vllm_engine, default_model_dir):
    """Put the shipped weights back into the shared engine after a test that changed them."""
    yield
    from transformers import AutoModelForCausalLM

    from trlx_scale.compat.vllm_weight_reload import reload_weights_in_place

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    worker = vllm_engine.llm_engine.model_executor.driver_worker
    reload_weights_in_place(worker, model.state_dict().items())
    vllm_engine.reset_prefix_cache()
