"""``ColocatedEngineMixin``: ``GRPOTrainer``'s vLLM engine in the training processes.

TRL builds its own colocated engine in ``__init__``; ``GRPOTrainer`` hands TRL a config that says ``use_vllm=False``
and builds trlx_scale's engine instead (``generation.engine.build_engine``: sleep/wake, LoRA-only or merged sync,
grouped generation, per-request seeds), at the trainer's policy version. TRL's ``_generate_single_turn`` then runs on
it, inside the ``generation`` phase (with the optimizer's states offloaded meanwhile where asked).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from ..compat import trl_trainer_state as trl_state
from ..optim.optimizer_offload import OptimizerStateOffloader
from ..options import option
from .engine import RolloutEngine, build_engine


class ColocatedEngineMixin:
    """Part of ``GRPOTrainer`` (see the module docstring); placed before TRL's class in its bases."""

    def _check_vllm_only_options(self) -> None:
        """The checks TRL's __init__ runs only when use_vllm is on (it saw it off); kept in step by a contract test."""
        if self.loss_type == "vespo" and self.vllm_importance_sampling_correction:
            if self.vllm_importance_sampling_mode not in ["token_truncate", "token_mask"]:
                raise ValueError(
                    f"VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or "
                    f"'token_mask'. Got: {self.vllm_importance_sampling_mode}."
                )

    def _build_colocated_engine(self) -> RolloutEngine:
        """The colocated engine, configured from TRL's GRPO fields as TRL configures its own, plus trlx_scale's."""
        args = self.args
        return build_engine(
            args,
            model=self.model,
            accelerator=self.accelerator,
            processing_class=self.processing_class,
            policy_version=policy_version_of(self),
            phase_timer=self.phase_timer,  # its weight syncs are their own phase
            structured_outputs_regex=args.vllm_structured_outputs_regex,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_length=args.vllm_max_model_length,
            max_num_seqs=args.per_device_train_batch_size * args.vllm_tensor_parallel_size * args.steps_per_generation,
            enable_sleep_mode=args.vllm_enable_sleep_mode,
            model_impl=args.vllm_model_impl,
            trust_remote_code=args.trust_remote_code,
            repetition_penalty=self.repetition_penalty,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            max_completion_length=self.max_completion_length,
            logprobs=0,  # only the sampled tokens' log-probs (importance-sampling correction)
            generation_kwargs=args.generation_kwargs,
        )

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        with self.phase_timer.phase("generation"):  # optimizer offload, wake, (sync), generate, sleep, reload
            offloader = None
            if option(self.args, "offload_optimizer_during_generation") and self.optimizer is not None:
                offloader = OptimizerStateOffloader(self.optimizer)
                offloaded = offloader.offload()
            engine = self._rollout_engine()
            if engine is not None:
                mode = "train" if self.model.training else "eval"
                engine.set_rollout_seed(self.args.seed, self.state.global_step, mode)
            try:
                result = super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images
                )
            finally:
                if offloader is not None:
                    offloader.reload()  # before the loss and the optimizer step
        self._count_generation(prompt_ids, result[0])  # TRL returns (completion_ids, logprobs)
        mode = "train" if self.model.training else "eval"
        if offloader is not None:
            trl_state.metrics(self, mode)["memory/optimizer_offloaded_gib"].append(offloaded / 2**30)
        if engine is not None:
            for name, value in engine.pop_metrics().items():
                trl_state.metrics(self, mode)[name].append(value)
        return result

    def _rollout_engine(self) -> RolloutEngine | None:
        """trlx_scale's engine, when this run generates with it (not with TRL's transformers path or server)."""
        engine = getattr(self, "vllm_generation", None)
        return engine if isinstance(engine, RolloutEngine) else None

    def _policy_engine(self) -> RolloutEngine | None:
        return self._rollout_engine()


def policy_version_of(trainer: Any) -> Callable[[], int]:
    """The engine's view of the trainer's policy version, holding the trainer weakly (no trainer <-> engine cycle:
    see profiling's _StepClock)."""
    ref = weakref.ref(trainer)

    def current() -> int:
        return ref().policy_version

    return current
