"""``ColocatedVLLMGeneration``: TRL's ``VLLMGeneration`` with the engine options trlx_scale controls.

It keeps TRL's interface (``generate``, ``sync_weights``, ``llm``) so every TRL code path that uses the engine works
unchanged, and adds:

- ``dtype``: the engine's weight dtype. TRL leaves it to vLLM, whose "auto" loads an fp32 checkpoint in bf16 on CPU,
  so vLLM's log-probs differ from an fp32 trainer's by ~0.02 (DESIGN.md) before any staleness.
- ``enforce_eager``: skip torch.compile. Left to vLLM, a tiny model's engine takes ~40 s to start on CPU instead of
  ~5 s, and CUDA graphs do not exist there. "auto" (None) = eager on CPU only, TRL's behaviour on GPUs.
- weight sync through vLLM's layer-wise in-place reload where the per-parameter path is broken
  (see ``trlx_scale.compat.vllm_weight_reload``).
"""

from __future__ import annotations

import logging
import os

import torch
from transformers import is_bitsandbytes_available
from trl.generation.vllm_generation import VLLMGeneration
from trl.import_utils import is_vllm_available
from trl.trainer.utils import ensure_master_addr_port

from ..compat.vllm_weight_reload import (
    needs_layerwise_reload,
    reload_weights_in_place,
    tied_weight_aliases,
    with_tied_aliases,
)
from .cpu_environment import running_on_cpu_only

logger = logging.getLogger(__name__)


class ColocatedVLLMGeneration(VLLMGeneration):
    """vLLM generation in the training processes ("colocate" mode), with explicit dtype and eager options."""

    def __init__(self, *args, dtype: str = "auto", enforce_eager: bool | None = None, **kwargs):
        self.dtype = dtype
        self.enforce_eager = running_on_cpu_only() if enforce_eager is None else enforce_eager
        self._tied_aliases: dict[str, str] | None = None
        super().__init__(*args, **kwargs)

    def llm_kwargs(self) -> dict:
        """Arguments of the colocated ``vllm.LLM``: TRL's choices plus ``dtype`` and ``enforce_eager``."""
        return dict(
            model=self.model.name_or_path,
            tensor_parallel_size=self.tensor_parallel_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_length,
            max_num_seqs=self.max_num_seqs,
            enable_sleep_mode=self.enable_sleep_mode,
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
        )

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

        accelerator = self.accelerator
        if accelerator.num_processes % self.tensor_parallel_size != 0:
            raise ValueError(
                f"vllm_tensor_parallel_size ({self.tensor_parallel_size}) must divide the number of processes "
                f"({accelerator.num_processes}); choose a divisor of it."
            )
        if self.tensor_parallel_size > 1:
            # Consecutive ranks form one tensor-parallel group: [0, 1], [2, 3], ... for size 2.
            self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
                [
                    list(range(i * self.tensor_parallel_size, (i + 1) * self.tensor_parallel_size))
                    for i in range(accelerator.num_processes // self.tensor_parallel_size)
                ]
            )
        # The external launcher reads the process layout from the environment.
        os.environ["RANK"] = str(accelerator.process_index)
        os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
        os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
        ensure_master_addr_port()

        self.llm = LLM(**self.llm_kwargs())
        if self.enable_sleep_mode:
            self.llm.sleep(level=2)
        self._llm_weights_sleeping = self.enable_sleep_mode
        # Keep ranks together after the (uneven) engine start-up; DeepSpeed hangs otherwise.
        accelerator.wait_for_everyone()

    def sync_weights(self) -> None:
        if not needs_layerwise_reload():
            super().sync_weights()
            return
        if self.enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        if self._tied_aliases is None:
            self._tied_aliases = tied_weight_aliases(self.model)
        worker = self.llm.llm_engine.model_executor.driver_worker
        # Every process iterates: gathering a ZeRO-3/FSDP parameter is a collective.
        reload_weights_in_place(worker, with_tied_aliases(self._iter_named_params(), self._tied_aliases))
        self.llm.reset_prefix_cache()
