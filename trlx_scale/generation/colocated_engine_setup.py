"""``GRPOTrainer``'s vLLM engine in the training processes: how it is built and how TRL's generation runs on it.

TRL builds its own colocated engine in ``__init__``; ``GRPOTrainer`` hands TRL a config that says ``use_vllm=False``
and builds trlx_scale's engine instead (``generation.engine.build_engine``: sleep/wake, LoRA-only or merged sync,
grouped generation, per-request seeds), at the trainer's policy version. TRL's ``_generate_single_turn`` then runs on
it, inside the ``generation`` phase (with the optimizer's states offloaded meanwhile where asked).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..compat import trl_trainer_state as trl_state
from ..optim.optimizer_offload import OptimizerStateOffloader
from .engine import RolloutEngine, build_engine


def check_vllm_only_options(trainer: Any) -> None:
    """The checks TRL's __init__ runs only when use_vllm is on (it saw it off); kept in step by a contract test."""
    if trainer.loss_type == "vespo" and trainer.vllm_importance_sampling_correction:
        if trainer.vllm_importance_sampling_mode not in ["token_truncate", "token_mask"]:
            raise ValueError(
                f"VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or "
                f"'token_mask'. Got: {trainer.vllm_importance_sampling_mode}."
            )


def build_colocated_engine(trainer: Any) -> RolloutEngine:
    """The colocated engine, configured from TRL's GRPO fields as TRL configures its own, plus trlx_scale's."""
    args = trainer.args
    return build_engine(
        args,
        model=trainer.model,
        accelerator=trainer.accelerator,
        processing_class=trainer.processing_class,
        policy_version=trainer.policy.current,
        phase_timer=trainer.phase_timer,  # its weight syncs are their own phase
        structured_outputs_regex=args.vllm_structured_outputs_regex,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        max_model_length=args.vllm_max_model_length,
        max_num_seqs=args.per_device_train_batch_size * args.vllm_tensor_parallel_size * args.steps_per_generation,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        model_impl=args.vllm_model_impl,
        trust_remote_code=args.trust_remote_code,
        repetition_penalty=trainer.repetition_penalty,
        temperature=trainer.temperature,
        top_p=trainer.top_p,
        top_k=trainer.top_k,
        min_p=trainer.min_p,
        max_completion_length=trainer.max_completion_length,
        logprobs=0,  # only the sampled tokens' log-probs (importance-sampling correction)
        generation_kwargs=args.generation_kwargs,
    )


def generate_single_turn(trainer: Any, base_generate: Callable, prompt_ids, *args, **kwargs):
    """TRL's ``_generate_single_turn`` (``base_generate``) inside the ``generation`` phase: the optimizer's states
    offloaded meanwhile where asked, the engine seeded for the step, its metrics and the profiler's count after."""
    with trainer.phase_timer.phase("generation"):  # optimizer offload, wake, (sync), generate, sleep, reload
        offloader = None
        if trainer.args.offload_optimizer_during_generation and trainer.optimizer is not None:
            offloader = OptimizerStateOffloader(trainer.optimizer)
            offloaded = offloader.offload()
        engine = trainer._rollout_engine()
        if engine is not None:
            mode = "train" if trainer.model.training else "eval"
            engine.set_rollout_seed(trainer.args.seed, trainer.state.global_step, mode)
        try:
            result = base_generate(prompt_ids, *args, **kwargs)
        finally:
            if offloader is not None:
                offloader.reload()  # before the loss and the optimizer step
    trainer.profiler.count_generation(prompt_ids, result[0])  # TRL returns (completion_ids, logprobs)
    metrics = trl_state.metrics(trainer, "train" if trainer.model.training else "eval")
    if offloader is not None:
        metrics["memory/optimizer_offloaded_gib"].append(offloaded / 2**30)
    if engine is not None:
        for name, value in engine.pop_metrics().items():
            metrics[name].append(value)
    return result
