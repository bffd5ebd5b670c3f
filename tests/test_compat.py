"""The vLLM weight-reload workaround (trlx_scale.compat.vllm_weight_reload): needed, and correct.

These tests fail when upstream changes: if vLLM's per-parameter load starts working again on CPU, or its reload API
changes, the workaround must be revisited.
"""

import os

import pytest
import torch
import vllm
from datasets import Dataset
from packaging.version import Version
from vllm import SamplingParams

from trlx_scale.compat.vllm_weight_reload import (
    needs_layerwise_reload,
    reload_weights_in_place,
    tied_weight_aliases,
    with_tied_aliases,
    worker_reload_signature_ok,
)

PROMPT = [3, 0x31 + 5, 0x32 + 5, 0x2B + 5, 0x33 + 5, 0x3D + 5, 4]  # arbitrary byte tokens framed by chat markers


def _engine_logprobs(llm, max_tokens=4):
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)
    output = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    return list(output.token_ids), [output.logprobs[i][t].logprob for i, t in enumerate(output.token_ids)]


def _model_logprobs(model, token_ids):
    with torch.no_grad():
        logps = torch.log_softmax(model(torch.tensor([PROMPT + token_ids])).logits[0], dim=-1)
    return [logps[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(token_ids)]


def _perturb(model, scale=0.05, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)


def test_version_guard_covers_the_installed_vllm():
    assert needs_layerwise_reload(Version("0.32.0")) and not needs_layerwise_reload(Version("0.31.1"))
    assert needs_layerwise_reload() == (Version(Version(vllm.__version__).base_version) >= Version("0.32.0"))


def test_reload_api_still_has_the_signature_we_call(vllm_engine):
    worker = vllm_engine.llm_engine.model_executor.driver_worker
    assert worker_reload_signature_ok(worker)


def test_tied_aliases_of_the_default_model(default_model):
    assert tied_weight_aliases(default_model) == {"model.embed_tokens.weight": "lm_head.weight"}
    names = [name for name, _ in with_tied_aliases(default_model.named_parameters(), {"model.norm.weight": "x"})]
    assert names[-2:] == ["model.norm.weight", "x"]


@pytest.mark.usefixtures("restore_engine_weights")
def test_per_parameter_load_is_broken_on_cpu_so_the_workaround_is_needed(vllm_engine, default_model):
    """TRL 1.16's sync path; when this starts passing upstream fixed it, and the workaround can go."""
    model_runner_model = vllm_engine.llm_engine.model_executor.driver_worker.model_runner.model
    name, tensor = (
        "model.layers.0.self_attn.q_proj.weight",
        default_model.state_dict()["model.layers.0.self_attn.q_proj.weight"],
    )
    with pytest.raises((AttributeError, AssertionError)):
        model_runner_model.load_weights([(name, tensor)])


@pytest.mark.usefixtures("restore_engine_weights")
def test_layerwise_reload_with_tied_alias_makes_vllm_match_new_weights(vllm_engine, default_model):
    _perturb(default_model)
    worker = vllm_engine.llm_engine.model_executor.driver_worker
    aliases = tied_weight_aliases(default_model)
    reload_weights_in_place(worker, with_tied_aliases(default_model.named_parameters(), aliases))
    token_ids, engine_logps = _engine_logprobs(vllm_engine)
    model_logps = _model_logprobs(default_model, token_ids)
    assert max(abs(a - b) for a, b in zip(engine_logps, model_logps, strict=True)) < 1e-4


@pytest.mark.usefixtures("restore_engine_weights")
def test_layerwise_reload_without_the_tied_alias_serves_wrong_weights(vllm_engine, default_model):
    """Why the alias is emitted: without lm_head in the stream, vLLM's output layer does not follow the update."""
    _perturb(default_model, seed=1)
    worker = vllm_engine.llm_engine.model_executor.driver_worker
    reload_weights_in_place(worker, default_model.named_parameters())
    token_ids, engine_logps = _engine_logprobs(vllm_engine)
    model_logps = _model_logprobs(default_model, token_ids)
    assert max(abs(a - b) for a, b in zip(engine_logps, model_logps, strict=True)) > 1e-2


# ---------------------------------------------------------------------------------------------- known warnings
def test_known_warnings_are_silenced_outside_pytest_too():
    """A user's `from trlx_scale import GRPOTrainer` prints neither TRL's vLLM-version warning nor vLLM's Triton line."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", "from trlx_scale import GRPOTrainer, DPOTrainer, PPOTrainer"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "TRL currently supports vLLM" not in result.stderr
    assert "Triton is installed" not in result.stderr


def test_known_warnings_still_match_upstream():
    """Fails when TRL or vLLM reword the messages (the filters would silence nothing) or vLLM leaves 0.32."""
    import importlib
    import inspect

    import vllm.triton_utils.importing as triton_importing

    from trlx_scale.compat.known_warnings import (
        TESTED_VLLM_SERIES,
        TRL_VLLM_VERSION_WARNING,
        VLLM_TRITON_CPU_MESSAGE,
        VLLM_TRITON_LOGGER,
        installed_vllm_version,
    )

    assert TRL_VLLM_VERSION_WARNING in inspect.getsource(importlib.import_module("trl.import_utils"))
    assert VLLM_TRITON_CPU_MESSAGE in inspect.getsource(triton_importing)
    # The module logs through init_logger(__name__), i.e. the standard logger of that name, which holds our filter.
    assert triton_importing.__name__ == VLLM_TRITON_LOGGER
    assert "logger = init_logger(__name__)" in inspect.getsource(triton_importing)
    assert installed_vllm_version().startswith(TESTED_VLLM_SERIES), "review compat/known_warnings.py for this vLLM"


# ---------------------------------------------------------------------------------------------- LoRA + prompt_logprobs
LORA_SCORING_PROBE = """
import os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, enable_lora=True, max_lora_rank=8, max_loras=1,
          max_model_len=64, max_num_seqs=4, seed=0)
prompt = [int(t) for t in sys.argv[2].split(",")]
try:
    # several sequences of different lengths, as a reference-scoring batch has
    llm.generate([{"prompt_token_ids": prompt[: 3 + i]} for i in range(4)],
                 SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    print("SCORED")
except Exception as error:
    print("FAILED", type(error).__name__, str(error)[:300])
"""


@pytest.mark.slow
def test_lora_enabled_cpu_engine_still_cannot_score_prompts(default_model_dir):
    """compat/vllm_cpu_lora_scoring.py is needed while this fails on the CPU build; when a vLLM release scores
    prompt_logprobs with enable_lora, this test fails and the workaround (full sync for scoring engines) can go.
    Run in its own process: an engine that failed mid-request is freed late, and its teardown would take down the
    process-wide parallel groups of the next engine this test session starts."""
    import subprocess
    import sys

    from trlx_scale.compat.vllm_cpu_lora_scoring import lora_breaks_prompt_logprobs, scoring_sync_mode

    assert lora_breaks_prompt_logprobs(cpu_only=True), (
        "vLLM changed: review compat/vllm_cpu_lora_scoring.py's version guard"
    )
    assert scoring_sync_mode("auto", cpu_only=True) == "full" and scoring_sync_mode("lora", cpu_only=True) == "full"
    assert scoring_sync_mode("lora", cpu_only=False) == "lora"  # GPU engines score prompts with LoRA on
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, "-c", LORA_SCORING_PROBE, default_model_dir, ",".join(map(str, PROMPT))],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith(("SCORED", "FAILED"))]
    assert lines and lines[-1].startswith("FAILED RuntimeError") and "einsum" in lines[-1], (
        result.stdout[-2000:] + result.stderr[-3000:]
    )


def test_vllm_serve_needs_the_module_entry_point_on_vllm_cpu():
    """compat/vllm_server_entrypoint.py: vllm-cpu registers no 'vllm' distribution, so `vllm serve` dies at start-up
    and the server module is used. Fails when a vllm-cpu release registers one (review the fallback then)."""
    import importlib.metadata

    from trlx_scale.compat.vllm_server_entrypoint import SERVER_MODULE, server_command, vllm_distribution_registered

    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:  # the GPU stack: upstream vLLM and its `vllm serve`
        assert vllm_distribution_registered()
        assert server_command("m")[1:] == ["serve", "m"]
        return
    assert not vllm_distribution_registered(), "vllm-cpu now registers 'vllm': review compat/vllm_server_entrypoint"
    assert server_command("m", python="/env/bin/python") == ["/env/bin/python", "-m", SERVER_MODULE, "--model", "m"]


def test_a_dropped_engine_resets_vllms_process_global_groups_so_it_is_finalized_before_the_next_one():
    """compat/vllm_engine_finalizers.py is needed while an in-process engine's finalizer resets vLLM's process-global
    parallel groups and engine start-up freezes the heap (which parks a dropped trainer's cycles). Fails when vLLM
    changes either, so the workaround is revisited."""
    import inspect

    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.core_client import InprocClient

    assert "weakref.finalize(self, self.engine_core.shutdown)" in inspect.getsource(InprocClient.__init__)
    assert "cleanup_dist_env_and_memory()" in inspect.getsource(EngineCore.shutdown)
    assert "freeze_gc_heap()" in inspect.getsource(EngineCore.__init__)


def test_the_in_process_engines_shutdown_finalizer_is_found(vllm_engine):
    """compat/vllm_engine_finalizers.in_process_engine_finalizer finds the finalizer process_exit skips: the live
    weakref.finalize that calls the engine core's shutdown. Fails when vLLM moves or changes it (the exit would then
    run the shutdown again: correct, 2-4 s slower)."""
    from trlx_scale.compat.vllm_engine_finalizers import in_process_engine_finalizer

    finalizer = in_process_engine_finalizer(vllm_engine)
    assert finalizer is not None and finalizer.alive
    client, function, _, _ = finalizer.peek()
    assert client is vllm_engine.llm_engine.engine_core
    core = client.engine_core
    assert function.__func__.__qualname__ == "EngineCore.shutdown" and function.__self__ is core
    assert in_process_engine_finalizer(object()) is None


def test_finalize_dropped_engines_runs_the_finalizer_of_a_frozen_cycle():
    """A trainer's engine sits in reference cycles that vLLM's gc.freeze() hid from the collector: the helper must
    still shut it down, at once."""
    import gc
    import weakref

    from trlx_scale.compat.vllm_engine_finalizers import finalize_dropped_engines

    class Engine:
        pass

    shut_down = []
    engine = Engine()
    engine.cycle = engine
    weakref.finalize(engine, shut_down.append, "engine")
    gc.freeze()  # what vLLM does at the end of its start-up
    try:
        del engine
        gc.collect()
        assert shut_down == [], "a plain collection does not see a frozen cycle (the reason for the helper)"
        finalize_dropped_engines()
        assert shut_down == ["engine"]
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("prefill", ["chunked", "whole"])
def test_seeded_requests_need_whole_prefills_on_vllm_cpu(prefill):
    """vLLM 0.32's CPU sampler cannot seed a request whose prompt is split across prefill chunks; the colocated engine
    turns chunking off on CPU (ColocatedVLLMGeneration.llm_kwargs). When the chunked case stops failing upstream,
    the workaround can go."""
    import subprocess
    import sys

    from .helpers.launch import REPO_ROOT, launch_env

    script = os.path.join(REPO_ROOT, "tests", "scripts", "seeded_chunked_prefill.py")
    result = subprocess.run(
        [sys.executable, script, prefill], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=launch_env()
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stderr[-3000:]
    expected = "RESULT CPU Generator does not use offset" if prefill == "chunked" else "RESULT OK"
    assert lines[-1] == expected


def test_tool_messages_render_off_the_trainer_as_trls_own_method_renders_them(default_model_dir, default_tokenizer):
    """compat/trl_tool_suffix.py calls TRL's _get_tool_suffix_ids with a stand-in holding a copy of the tokenizer:
    the ids must be the trainer's own method's, and the stand-in must carry every attribute the method reads (a TRL
    that reads another fails here with an AttributeError naming it)."""
    import copy

    from trlx_scale import GRPOTrainer
    from trlx_scale.compat import trl_tool_suffix
    from trlx_scale.tasks.tool_chat_template import with_tool_template

    from .helpers.trainers import small_grpo_config

    assert trl_tool_suffix.supported()

    def lookup(q: str) -> str:
        """Look a query up.

        Args:
            q: The query.
        """
        return q

    tokenizer = with_tool_template(default_tokenizer)
    trainer = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=small_grpo_config("/tmp/trlx_scale_compat_suffix", max_steps=1),
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1"}]}] * 8),
        processing_class=tokenizer,
        tools=[lookup],
    )
    render = trl_tool_suffix.tool_suffix_renderer(trainer, copy.deepcopy(tokenizer))
    for messages in (
        [{"role": "tool", "name": "lookup", "content": "12"}],
        [{"role": "tool", "name": "lookup", "content": "a"}, {"role": "tool", "name": "lookup", "content": "bb"}],
    ):
        assert render(messages) == trainer._get_tool_suffix_ids(messages) and render(messages)


def test_checked_reload_wraps_what_vllms_reload_still_calls():
    """compat/vllm_checked_reload.py relies on vLLM's in-place reload calling ``model.load_weights`` once with the
    files' tensors and on its naming of the parameters; this fails when upstream changes either. The extension is
    passed to every server trlx_scale starts."""
    import inspect

    from vllm.model_executor.model_loader.reload import inplace

    from trlx_scale.compat.vllm_checked_reload import WORKER_EXTENSION, CheckedWeightReload
    from trlx_scale.generation.vllm_server import ServerLaunch

    source = inspect.getsource(inplace.reload_weights)
    assert "loaded_weights = model.load_weights(weights_iterator)" in source
    assert 'name.replace(".base_layer.", ".") if vllm_config.lora_config else name' in source
    assert "Following weights were not loaded from checkpoint" in source  # still only logged upstream
    from vllm.v1.worker.gpu_worker import Worker

    assert callable(getattr(Worker, "reload_weights", None)) and callable(CheckedWeightReload.reload_weights_checked)
    argv = ServerLaunch(model="m", port=1).arguments()
    assert argv[argv.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert (
        "--worker-extension-cls"
        not in ServerLaunch(model="m", port=1, extra_args=("--worker-extension-cls", "x")).arguments()[:-2]
    )


def test_the_cpu_platform_still_forces_a_spinning_worker_unless_multiprocessing_is_off():
    """compat/vllm_cpu_server_executor.py: vLLM's CPU platform swaps the uni executor for the multiprocessing one
    unless VLLM_ENABLE_V1_MULTIPROCESSING is "0", and that executor's worker reads its steps from a shared-memory queue
    that busy-loops for a second after each read. Fails when either changes upstream (review the workaround then)."""
    import inspect

    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.platforms.cpu import CpuPlatform

    from trlx_scale.compat import vllm_cpu_server_executor as executor

    assert executor.supported(), (
        "the installed vLLM is not the series compat/vllm_cpu_server_executor.py was checked on"
    )
    rule = " ".join(inspect.getsource(CpuPlatform.check_and_update_config).split())
    assert 'os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1"' in rule
    assert 'and parallel_config.distributed_executor_backend == "uni"' in rule
    assert 'parallel_config.distributed_executor_backend = "mp"' in rule
    assert inspect.signature(SpinCondition.__init__).parameters["busy_loop_s"].default == 1
    assert "sched_yield()" in inspect.getsource(SpinCondition.wait)


def test_the_uni_executor_is_asked_for_unless_the_caller_chose_one():
    from trlx_scale.compat.vllm_cpu_server_executor import uni_executor_arguments, uni_executor_environment
    from trlx_scale.generation.cpu_environment import running_on_cpu_only
    from trlx_scale.generation.vllm_server import ServerLaunch

    assert uni_executor_arguments(()) == ["--distributed-executor-backend", "uni"]
    for chosen in (
        ("--distributed-executor-backend", "mp"),
        ("--distributed-executor-backend=mp",),
        ("--distributed_executor_backend", "mp"),
        ("--tensor-parallel-size", "2"),
        ("-tp", "2"),
        ("--pipeline_parallel_size=2",),
    ):
        assert uni_executor_arguments(chosen) == [], chosen
    assert uni_executor_environment(["x", "--distributed-executor-backend", "uni"]) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"
    }
    assert uni_executor_environment(["--distributed-executor-backend=mp"]) == {}
    assert (
        uni_executor_environment(["--distributed-executor-backend", "uni", "--distributed_executor_backend", "mp"])
        == {}
    )
    launch = ServerLaunch(model="m", enable_lora=False)
    by_hand = ServerLaunch(model="m", enable_lora=False, extra_args=("--distributed-executor-backend", "mp"))
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in by_hand.environment({})
    assert by_hand.arguments().count("--distributed-executor-backend") == 1
    if running_on_cpu_only():
        assert launch.environment({})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in launch.shell_command()
    else:  # GPUs: vLLM's own executor (one rank is the uni executor there already)
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in launch.environment({})
        assert "--distributed-executor-backend" not in launch.arguments()


def test_an_engine_whose_owner_is_freed_waits_for_the_next_engine_start():
    """compat/vllm_engine_finalizers.py: a colocated engine outlives its freed owner until finalize_dropped_engines
    (run right before an engine is built), never shutting down under a live engine in between."""
    import weakref

    from trlx_scale.compat.vllm_engine_finalizers import finalize_dropped_engines, retire_when_dropped

    class Owner:
        pass

    class Engine:
        pass

    owner, engine = Owner(), Engine()
    retire_when_dropped(owner, engine)
    alive = weakref.ref(engine)
    del engine
    assert alive() is not None  # the owner holds it
    del owner
    assert alive() is not None  # parked: the owner is gone, the engine has not shut down
    finalize_dropped_engines()
    assert alive() is None
