"""``ColocatedVLLMGeneration``: the engine component every trlx_scale trainer uses in colocate mode.

It implements ``engine.RolloutEngine`` (trainers build it with ``engine.build_engine``) and subclasses TRL's
``VLLMGeneration``, keeping its interface (``sync_weights()``, ``generate(...)``, ``llm``), so TRL's trainer code
drives it unchanged; it is the only object that talks to vLLM. Per rollout:

    wake(weights) -> sync to the trainer's policy version if not served yet (LoRA adapter only, or every weight in
    buckets) -> wake(kv_cache) -> reset prefix cache -> TRL's generate, each group's prompt sent once with n samples
    -> sleep

What is TRL's and what is ours:

- ``generate`` is TRL's (``super().generate``: sampling parameters, structured outputs, tensor-parallel gather and
  slice, images), run on ``GroupedLLM`` (``grouped_llm``: a group's prompt once with n samples, the adapter served)
  inside the explicit sleep/wake lifecycle (``lifecycle.EngineLifecycle``, level chosen by the sync mode);
- ``_init_vllm`` is ours: TRL builds the ``vllm.LLM`` inline with no hook for the arguments added here (``dtype``,
  ``enforce_eager``, LoRA serving, prefix caching); its tensor-parallel groups and launcher environment are copied
  from TRL 1.16.0 in two small helpers, pinned by tests/test_trl_contract.py;
- ``sync_weights`` is ours: TRL calls it when its step changed, and it brings the engine to the trainer's policy
  version (``ensure_version``: the one "is the engine current" check), by LoRA-only or bucketed full sync
  (``weight_sync``) over the in-process transport (``weight_transport``);
- per-round metrics (``pop_metrics``): sync time and bytes, wake/sleep/generation time, tokens/s, device memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import is_bitsandbytes_available
from trl.generation.vllm_generation import VLLMGeneration
from trl.import_utils import is_vllm_available
from trl.trainer.utils import ensure_master_addr_port

from ..compat import trl_trainer_state as trl_state
from ..compat.vllm_engine_finalizers import finalize_dropped_engines, in_process_engine_finalizer, retire_when_dropped
from ..compat.vllm_weight_reload import tied_weight_aliases, with_tied_aliases
from ..peft_models import is_peft_model
from ..process_exit import skip_at_exit
from ..profiling.phase_timer import PhaseTimer
from ..reliability.input_checks import check_prompts_fit_context
from .cpu_environment import running_on_cpu_only
from .engine_options import (
    check_positive,
    check_sleep_level,
    check_sync_mode,
    check_tensor_parallel_layout,
    check_vllm_dtype,
    resolve_sleep_level,
)
from .grouped_llm import GroupedLLM
from .lifecycle import EngineLifecycle
from .rollout_seeds import RolloutSeedContext
from .weight_sync import (
    CPU_MERGED_SYNC_REASON,
    LoRAAdapterSync,
    choose_sync_mode,
    full_weight_stream,
    is_fsdp2_sharded,
)
from .weight_transport import InProcessTransport, WeightTransport

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ColocatedVLLMGeneration(VLLMGeneration):
    """vLLM generation in the training processes ("colocate" mode).

    Args (besides TRL's ``VLLMGeneration`` arguments):
        dtype: engine weight dtype ("auto" leaves it to vLLM).
        enforce_eager: skip torch.compile; None = eager on CPU only.
        sync_mode: "auto" (LoRA-only when vLLM can serve the adapter, else full), "lora" or "full".
        sleep_level: "auto" (1 for LoRA-only sync, 2 for full), 1 or 2; used when ``enable_sleep_mode``.
        sync_bucket_mb: size of the buckets a full sync gathers and pushes at a time.
        per_request_seed: seed each request from (seed, rank, step, prompt) once ``set_rollout_seed`` was called.
        policy_version: returns the trainer's current policy version (``rollout.policy_version``); None (an engine
            driven by hand, as in tests and benchmarks): every sync pushes, and an asleep engine syncs on waking.
    """

    in_training_processes = True  # the planner counts the engine in each training process's memory

    def __init__(
        self,
        *args,
        dtype: str = "auto",
        enforce_eager: bool | None = None,
        sync_mode: str = "auto",
        sleep_level: str | int = "auto",
        sync_bucket_mb: float = 256.0,
        per_request_seed: bool = False,
        policy_version: Callable[[], int] | None = None,
        **kwargs,
    ):
        self.dtype = check_vllm_dtype(dtype)
        self.enforce_eager = running_on_cpu_only() if enforce_eager is None else enforce_eager
        self.requested_sync_mode = check_sync_mode(sync_mode)
        self.requested_sleep_level = check_sleep_level(sleep_level)
        self.sync_bucket_bytes = int(check_positive("vllm_sync_bucket_mb", sync_bucket_mb) * 2**20)
        self.per_request_seed = per_request_seed
        self._policy_version = policy_version
        self.served_version: int | None = None  # the policy version the engine's weights are (None: not synced yet)
        self.transport: WeightTransport | None = None  # set with the vLLM engine (_init_vllm)
        self._tied_aliases: dict[str, str] | None = None
        self._step_metrics: dict[str, float] = {}
        # The trainer's step profiler (trlx_scale.profiling); a weight sync is its own phase inside generation.
        self.phase_timer = PhaseTimer(enabled=False)
        # Names of the trainer's parameters that are not the policy's weights (PPO's shared-base value head lives on
        # the policy's module so that it is sharded with it): left out of every sync.
        self.excluded_parameter_prefixes: tuple[str, ...] = ()
        self._continuing_turns = False  # inside TRL's lockstep tool loop (``continuing_turns``)
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ construction

    def llm_kwargs(self) -> dict:
        """Arguments of the colocated ``vllm.LLM``: TRL's choices plus trlx_scale's."""
        kwargs = dict(
            model=self.model.name_or_path,
            tensor_parallel_size=self.tensor_parallel_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_length,
            max_num_seqs=self.max_num_seqs,
            enable_sleep_mode=self.sleep_supported and self.enable_sleep_mode,
            model_impl=self.model_impl,
            # One engine per training process (or per tensor-parallel group), driven by torch.distributed.
            distributed_executor_backend="external_launcher",
            # Ranks of one tensor-parallel group must sample identically.
            seed=self.accelerator.process_index // self.tensor_parallel_size,
            # vLLM's memory profiler over-reserves with its default of 32768 when it shares the device.
            max_num_batched_tokens=4096,
            # Log-probs after temperature/processors, as the importance-sampling correction needs.
            logprobs_mode="processed_logprobs",
            quantization=self._quantization(),
            trust_remote_code=self.trust_remote_code,
            dtype=self.dtype,
            enforce_eager=self.enforce_eager,
            # A group's prompt is computed once and its KV blocks shared by the n samples.
            enable_prefix_caching=True,
        )
        if self.sync_mode == "lora":
            kwargs.update(enable_lora=True, max_lora_rank=self._lora_sync.max_lora_rank, max_loras=1)
        if running_on_cpu_only():
            # vLLM 0.32's CPU sampler cannot seed a request whose prompt is split across prefill chunks ("CPU
            # Generator does not use offset"), which happens as soon as a round's prompts pass one chunk: per-request
            # seeds and every multi-turn trajectory's turns are seeded. Whole prompts per step instead; the batch
            # must then hold the longest prompt. tests/test_compat.py fails once vLLM seeds split prompts on CPU.
            context = self.max_model_length or getattr(self.model.config, "max_position_embeddings", 4096)
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(4096, int(context)))
        return kwargs

    def _quantization(self) -> str | None:
        if not is_bitsandbytes_available():
            return None
        import bitsandbytes as bnb

        for module in self.model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                return "bitsandbytes"
            if isinstance(module, bnb.nn.Linear8bitLt):
                raise ValueError("vLLM does not support in-flight 8-bit quantization; load the policy in 4-bit.")
        return None

    def _init_vllm(self) -> None:
        if self.mode != "colocate":
            raise ValueError(f"ColocatedVLLMGeneration runs vLLM in 'colocate' mode only, got mode={self.mode!r}.")
        if not is_vllm_available():
            raise ImportError(
                "use_vllm=True needs vLLM: `pip install 'trlx-scale[vllm]'` on GPUs, `pip install 'trlx-scale[cpu]'` "
                "on CPU-only machines."
            )
        from vllm import LLM
        from vllm.platforms import current_platform

        self.sleep_supported = current_platform.is_sleep_mode_available()
        if self.enable_sleep_mode and not self.sleep_supported:
            logger.warning(
                "vLLM has no sleep mode on this platform (%s): the sleep/wake lifecycle runs with the vLLM calls "
                "skipped, so the engine keeps its memory between rollouts.",
                current_platform.device_name,
            )
        self.sync_mode, why_not_lora = choose_sync_mode(
            self.model, self.requested_sync_mode, cpu_engine=running_on_cpu_only()
        )
        if self.sync_mode == "full" and why_not_lora and is_peft_model(self.model):
            # A choice for speed is news (info); an adapter vLLM cannot serve is a limitation (warning).
            log = logger.info if why_not_lora == CPU_MERGED_SYNC_REASON else logger.warning
            log("LoRA-only weight sync is off (%s): merged full weights are sent instead.", why_not_lora)
        self.sleep_level = resolve_sleep_level(self.requested_sleep_level, self.sync_mode)
        if self.sync_mode == "lora":
            self._lora_sync = LoRAAdapterSync(
                self.model, trl_state.distributed_backend(self).gather_params, self._engine_torch_dtype()
            )

        # A dropped trainer's engine, freed by the garbage collector inside this start-up, would reset vLLM's
        # process-global groups (and torch's default group) under the new engine: shut such engines down first,
        # before any group of this engine exists.
        finalize_dropped_engines()
        self._join_tensor_parallel_group()
        self._export_launcher_environment()
        engine = LLM(**self.llm_kwargs())
        shutdown = in_process_engine_finalizer(engine)
        if shutdown is not None:  # a process leaving through process_exit need not tidy its own memory (2-4 s)
            skip_at_exit(shutdown)
        retire_when_dropped(self, engine)  # shut down before the next engine starts, not under a live one
        self.llm = GroupedLLM(engine)
        self.transport = InProcessTransport(self.llm)
        self.lifecycle = EngineLifecycle(
            engine,
            sleep_level=self.sleep_level,
            enabled=self.sleep_supported and self.enable_sleep_mode,
            start_asleep=False,
        )
        if self.enable_sleep_mode:
            # The engine loaded the checkpoint; nothing generates before the first sync, so hand the memory back.
            self.lifecycle.sleep()
        trl_state.set_weights_sleeping(self, self.lifecycle.weights_discarded)
        # Keep ranks together after the (uneven) engine start-up; DeepSpeed hangs otherwise (TRL does the same).
        self.accelerator.wait_for_everyone()

    # Copied from TRL 1.16.0 ``VLLMGeneration._init_vllm`` (colocate branch), which builds the ``vllm.LLM`` inline and
    # leaves no hook for the engine arguments trlx_scale adds; tests/test_trl_contract.py pins these lines of TRL's.
    def _join_tensor_parallel_group(self) -> None:
        tp, world = self.tensor_parallel_size, self.accelerator.num_processes
        check_tensor_parallel_layout(tp, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if tp > 1:
            # Consecutive ranks form one tensor-parallel group: [0, 1], [2, 3], ... for size 2.
            self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
                [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)]
            )

    def _export_launcher_environment(self) -> None:
        """vLLM's external launcher reads the process layout from the environment."""
        os.environ["RANK"] = str(self.accelerator.process_index)
        os.environ["LOCAL_RANK"] = str(self.accelerator.local_process_index)
        os.environ["WORLD_SIZE"] = str(self.accelerator.num_processes)
        ensure_master_addr_port()

    def _engine_torch_dtype(self) -> torch.dtype:
        if self.dtype in _DTYPES:
            return _DTYPES[self.dtype]
        if hasattr(self, "llm"):
            return self.llm.llm_engine.model_config.dtype
        # "auto" before the engine exists: vLLM follows the checkpoint's dtype (bf16 on CPU for fp32 checkpoints).
        return torch.bfloat16 if running_on_cpu_only() else getattr(self.model.config, "dtype", torch.bfloat16)

    # ------------------------------------------------------------------ weight sync

    def sync_weights(self) -> None:
        """TRL's entry point (called when TRL's step changed): serve the trainer's current policy version."""
        self.ensure_version(self._current_version())

    def _current_version(self) -> int | None:
        return None if self._policy_version is None else self._policy_version()

    def ensure_version(self, version: int | None) -> bool:
        """Wake the weights and, unless they already are policy ``version``, bring them to it; True if it synced.

        Current means: the engine serves ``version`` and still holds its weights (a level-2 sleep discards them, so
        the next round re-sends them whatever the version). ``version`` None (no version source): always sync."""
        base_discarded = self.lifecycle.weights_discarded
        self.lifecycle.wake_weights()
        if version is not None and version == self.served_version and not base_discarded:
            return False
        with self.phase_timer.phase("weight_sync"):
            self._sync_weights(base_discarded)
        self.served_version = version
        return True

    def _sync_weights(self, base_discarded: bool) -> None:
        start = time.perf_counter()
        if self.sync_mode == "lora":
            if base_discarded:  # level-2 sleep dropped the base too: refill it (unmerged) before the adapter
                if self._tied_aliases is None:
                    self._tied_aliases = tied_weight_aliases(self.model)
                self._push_weights(with_tied_aliases(self._lora_sync.base_weights(), self._tied_aliases))
            sent = self._lora_sync.write_adapter()
            self.transport.serve_adapter(self._lora_sync.request())
        else:
            counter: dict[str, int] = {}
            self._push_weights(self._full_weights(counter))
            sent = counter.get("bytes", 0)
        trl_state.set_weights_sleeping(self, False)
        self._step_metrics["sync/seconds"] = time.perf_counter() - start
        self._step_metrics["sync/bytes"] = float(sent)
        self._step_metrics["sync/lora_only"] = float(self.sync_mode == "lora")

    def _full_weights(self, counter: dict[str, int]):
        if self._tied_aliases is None:
            self._tied_aliases = tied_weight_aliases(self.model)
        dtype = self._engine_torch_dtype()
        if is_peft_model(self.model) or (
            trl_state.distributed_backend(self).is_fsdp and not is_fsdp2_sharded(self.model)
        ):
            # Merging an adapter needs the whole layer gathered, and FSDP1 gathers module by module: TRL's iterator.
            # Plain, ZeRO-3 (bucketed gathers) and FSDP2 (DTensor gathers) models stream through ours.
            def weights():
                for name, tensor in self._iter_named_params():
                    if self._excluded(name):
                        continue
                    tensor = tensor.to(dtype)
                    counter["bytes"] = counter.get("bytes", 0) + tensor.numel() * tensor.element_size()
                    yield name, tensor

            named = weights()
        else:
            params = [
                (self._fix_param_name_to_vllm(n), p) for n, p in self.model.named_parameters() if not self._excluded(n)
            ]
            named = full_weight_stream(
                params, trl_state.distributed_backend(self).gather_params, dtype, self.sync_bucket_bytes, counter
            )
        return with_tied_aliases(named, self._tied_aliases)

    def _excluded(self, name: str) -> bool:
        name = name.removeprefix("base_model.model.")
        return any(name.startswith(prefix) for prefix in self.excluded_parameter_prefixes)

    def _push_weights(self, named_weights) -> None:
        self.transport.load_weights(named_weights)

    # ------------------------------------------------------------------ generation

    def set_rollout_seed(self, seed: int, step: int, mode: str = "train") -> None:
        """The seed context of the next rollouts (no effect unless ``per_request_seed``): see rollout_seeds.py."""
        if self.per_request_seed:
            rank = self.accelerator.process_index // self.tensor_parallel_size  # a TP group samples identically
            self.llm.seed_context = RolloutSeedContext(seed, rank, step, mode)

    def generate(self, prompts, images, num_generations, profiler=None):
        """TRL's colocate ``generate``, run on ``GroupedLLM`` inside the engine's lifecycle:
        sync if asleep -> wake the KV cache -> reset the prefix cache -> TRL's generate -> sleep."""
        context = self.llm.llm_engine.model_config.max_model_len
        # Before waking. A later turn of TRL's lockstep tool loop asks for max_completion_length tokens after the held
        # ones and cuts the excess itself: only vLLM's own rule (the prompt leaves room for a token) applies there.
        budget = 1 if self._continuing_turns else self.max_completion_length
        check_prompts_fit_context(_prompt_token_ids(prompts), budget, context)
        memory_before = _device_memory()
        self._serve_current_version()
        self.lifecycle.wake_kv_cache()
        self.lifecycle.begin_generation()
        start = time.perf_counter()
        try:
            result = super().generate(prompts, images, num_generations, profiler)
        finally:
            # Also after a failure, so that the engine never stays GENERATING (a retry would be refused).
            seconds = time.perf_counter() - start
            memory_awake = _device_memory()
            self.lifecycle.end_generation(sleep=self.enable_sleep_mode)
            trl_state.set_weights_sleeping(self, self.lifecycle.weights_discarded)
        self._record_generation(result[1], seconds, memory_before, memory_awake)
        return result

    @contextlib.contextmanager
    def continuing_turns(self) -> Iterator[None]:
        """While TRL's lockstep tool loop generates later turns through ``generate`` (see there)."""
        self._continuing_turns = True
        try:
            yield
        finally:
            self._continuing_turns = False

    @contextlib.contextmanager
    def serving_turns(self) -> Iterator[Any]:
        """The engine awake for a multi-turn rollout's later turns (``agents.colocated_turn_sampler``): the same
        round as ``generate``'s (serve the current version, wake the KV cache, sleep afterwards, also after a
        failure); yields the ``vllm.LLM`` whose requests the turns add, with the adapter to serve them with."""
        self._serve_current_version()
        self.lifecycle.wake_kv_cache()
        self.lifecycle.begin_generation()
        start = time.perf_counter()
        try:
            yield self.llm.inner
        finally:
            self._step_metrics["generation/later_turns_seconds"] = time.perf_counter() - start
            self.lifecycle.end_generation(sleep=self.enable_sleep_mode)
            trl_state.set_weights_sleeping(self, self.lifecycle.weights_discarded)

    def turn_sampling_params(self, max_tokens: int, seed: int | None) -> Any:
        """``SamplingParams`` of one later turn: TRL's colocate parameters (``generate``: temperature, top-p/k,
        min-p, repetition penalty, log-probs, ``generation_kwargs``, structured outputs) with the turn's token
        budget and seed, so a turn samples from the distribution TRL's loop would sample it from."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        kwargs = {
            "n": 1,
            "repetition_penalty": self.repetition_penalty,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "max_tokens": max_tokens,
            "logprobs": self.logprobs,
        }
        kwargs.update(self.generation_kwargs)
        if self.structured_outputs_regex is not None:
            kwargs["structured_outputs"] = StructuredOutputsParams(regex=self.structured_outputs_regex)
        elif isinstance(kwargs.get("structured_outputs"), dict):
            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        kwargs["max_tokens"] = max_tokens  # the turn's budget, whatever generation_kwargs says
        kwargs["seed"] = seed
        kwargs["skip_special_tokens"] = False  # the ids are what count; the text is decoded by the trainer
        return SamplingParams(**kwargs)

    def _record_generation(self, completion_ids, seconds: float, memory_before, memory_awake) -> None:
        tokens = sum(len(ids) for ids in completion_ids)
        self._step_metrics.update(
            {
                "generation/seconds": seconds,
                "generation/tokens_per_second": tokens / max(seconds, 1e-9),
                "generation/unique_prompts": float(self.llm.last_unique_prompts),
                "lifecycle/wake_weights_seconds": self.lifecycle.timings.get("wake_weights", 0.0),
                "lifecycle/wake_kv_cache_seconds": self.lifecycle.timings.get("wake_kv_cache", 0.0),
                "lifecycle/sleep_seconds": self.lifecycle.timings.get("sleep", 0.0),
            }
        )
        if memory_before is not None:
            self._step_metrics["memory/device_gib_before_generation"] = memory_before
            self._step_metrics["memory/device_gib_during_generation"] = memory_awake
            self._step_metrics["memory/device_gib_after_sleep"] = _device_memory()

    def sequence_logprobs(self, sequences: list[list[int]], use_adapter: bool = False) -> list[list[float]]:
        """Log-prob of each token of each sequence given the tokens before it (``len - 1`` values per sequence).

        One prefill per sequence through vLLM's ``prompt_logprobs`` (no sampling: one dummy token is generated),
        at temperature 1 (raw model log-probs). ``use_adapter=False`` scores the base weights even when a LoRA adapter
        is loaded, which is the reference of a LoRA policy. The engine sleeps afterwards when sleep mode is on.
        """
        from vllm import SamplingParams

        self._serve_current_version()
        self.lifecycle.wake_kv_cache()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, top_p=1.0, top_k=0)
        self.lifecycle.begin_generation()
        start = time.perf_counter()
        outputs = self.llm.inner.generate(
            [{"prompt_token_ids": list(ids)} for ids in sequences],
            sampling_params=params,
            lora_request=self.llm.lora_request if use_adapter else None,
            use_tqdm=False,
        )
        self._step_metrics["scoring/seconds"] = time.perf_counter() - start
        self.lifecycle.end_generation(sleep=self.enable_sleep_mode)
        trl_state.set_weights_sleeping(self, self.lifecycle.weights_discarded)
        # prompt_logprobs[t] holds the sampled-or-actual token's entry for position t (None at t=0).
        return [
            [position[token].logprob for position, token in zip(output.prompt_logprobs[1:], ids[1:], strict=True)]
            for output, ids in zip(outputs, sequences, strict=True)
        ]

    def _serve_current_version(self) -> None:
        """Before a round: never generate with stale weights. With a version source that is one comparison; an
        engine driven by hand syncs when it slept since its last sync (weights to wake, or to refill at level 2)."""
        if self._policy_version is not None or self.lifecycle.state is self.lifecycle.state.ASLEEP:
            self.ensure_version(self._current_version())

    def pop_metrics(self) -> dict[str, float]:
        """Metrics of the rounds since the last call (the trainer logs them through TRL's metric path)."""
        metrics, self._step_metrics = self._step_metrics, {}
        return metrics


def _prompt_token_ids(prompts) -> list:
    """TRL hands token-id lists (or dicts holding them, for multimodal rows)."""
    return [p["prompt_token_ids"] if isinstance(p, dict) else p for p in prompts]


def _device_memory() -> float | None:
    """GiB allocated on the current CUDA device, or None off CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.memory_allocated() / 2**30
