"""Every private attribute of TRL's trainers (and of transformers' ``Trainer``) that trlx_scale reads or writes.

Why: a subclass of TRL's ``GRPOTrainer`` / ``DPOTrainer`` has to reach state TRL keeps under private names where TRL
leaves no public hook: the per-step metric lists its ``log`` averages (``_metrics``), the reward log of its
completions table (``_logs``), the tokenizer it unwraps from a processor (``_tokenizer``), the per-batch environment
and tool state its generation driver reads (``_batch_environments``, ``_sync_tool_dicts``, ...), the generation
buffer it steps through (``_buffered_inputs``, ``_step``) and the vLLM engine's own flags (``_dist``,
``_llm_weights_sleeping``). Each is named once, here; the rest of the package calls these functions, so a TRL release
that renames one is a change to this file alone.

Covered: TRL 1.16 (checked: 1.16.0), transformers 5.19. ``tests/test_trl_contract.py`` reads TRL's and transformers'
sources and fails when one of ``TRAINER_ATTRIBUTES`` / ``GENERATION_ATTRIBUTES`` is no longer assigned there.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import trl

TESTED_TRL = ("1.16",)

# attribute -> the upstream source file (relative to site-packages) that assigns it
TRAINER_ATTRIBUTES: dict[str, str] = {
    "_metrics": "trl/trainer/grpo_trainer.py",
    "_logs": "trl/trainer/grpo_trainer.py",
    "_tokenizer": "trl/trainer/grpo_trainer.py",
    "_is_vlm": "trl/trainer/grpo_trainer.py",
    "_multi_environment": "trl/trainer/grpo_trainer.py",
    "_env_tools": "trl/trainer/grpo_trainer.py",
    "_standalone_tools": "trl/trainer/grpo_trainer.py",
    "_batch_environments": "trl/trainer/grpo_trainer.py",
    "_sync_tool_dicts": "trl/trainer/grpo_trainer.py",
    "_async_tool_dicts": "trl/trainer/grpo_trainer.py",
    "_buffered_inputs": "trl/trainer/grpo_trainer.py",
    "_step": "trl/trainer/grpo_trainer.py",
    "_last_loaded_step": "trl/trainer/grpo_trainer.py",
    "_pending_extra_logs": "trl/trainer/grpo_trainer.py",
    "_pending_metrics": "trl/trainer/grpo_trainer.py",
    "_total_train_tokens": "trl/trainer/dpo_trainer.py",
}
GENERATION_ATTRIBUTES: dict[str, str] = {
    "_dist": "trl/generation/vllm_generation.py",
    "_llm_weights_sleeping": "trl/generation/vllm_generation.py",
}


def supported() -> bool:
    """Whether this TRL is one whose private state this module was checked against."""
    return trl.__version__.startswith(TESTED_TRL)


# ---------------------------------------------------------------- metrics and logs
def metrics(trainer: Any, mode: str) -> defaultdict[str, list[float]]:
    """TRL's per-mode metric lists (``"train"`` / ``"eval"``): what is appended here is averaged by TRL's ``log``."""
    return trainer._metrics[mode]


def reward_logs(trainer: Any) -> dict[str, Any]:
    """TRL's rollout log (prompts, completions, rewards per function, advantages) behind its completions table."""
    return trainer._logs


def pending_logs(trainer: Any) -> tuple[Any, Any]:
    """TRL's logs of an in-flight rollout that its next ``log`` merges: ``(extra_logs, metrics)``."""
    return trainer._pending_extra_logs, trainer._pending_metrics


# ---------------------------------------------------------------- the tokenizer and the model kind
def tokenizer(trainer: Any) -> Any:
    """The tokenizer TRL unwrapped from the processing class (the processor's own for a VLM)."""
    return trainer._tokenizer


def is_vlm(trainer: Any) -> bool:
    """Whether TRL took the model for a vision-language model."""
    return bool(trainer._is_vlm)


# ---------------------------------------------------------------- environments and tools
def multi_environment(trainer: Any) -> bool:
    """Whether ``environment_factory`` was a dict of factories (rows name theirs in an ``environment`` column)."""
    return bool(trainer._multi_environment)


def environment_tool_schemas(trainer: Any, name: Any) -> Any:
    """The tool schemas TRL renders a prompt of environment ``name`` with."""
    return trainer._env_tools[name]


def standalone_tools(trainer: Any) -> list[Any]:
    """The ``tools=`` functions, shared by every rollout."""
    return list(trainer._standalone_tools)


def batch_environments(trainer: Any) -> list[Any] | None:
    """The environment name of each row of the batch TRL's driver renders (None before the first batch)."""
    return getattr(trainer, "_batch_environments", None)


def set_batch_environments(trainer: Any, names: list[Any] | None) -> None:
    """Set (or, with None, remove) the batch's environment names, as TRL's ``_generate_and_score_completions``."""
    if names is None:
        if hasattr(trainer, "_batch_environments"):
            del trainer._batch_environments
        return
    trainer._batch_environments = names


def set_tool_dicts(trainer: Any, tool_dicts: tuple[list[dict], list[dict]]) -> None:
    """Each rollout's synchronous and asynchronous tool functions, as TRL's driver reads them."""
    trainer._sync_tool_dicts, trainer._async_tool_dicts = tool_dicts


def rollout_tools(trainer: Any, index: int) -> dict[str, Any]:
    """Rollout ``index``'s tool functions by name, synchronous and asynchronous together."""
    return {**trainer._sync_tool_dicts[index], **trainer._async_tool_dicts[index]}


# ---------------------------------------------------------------- the generation buffer and the loaded step
def generation_buffer(trainer: Any) -> tuple[int, Any]:
    """TRL's step counter over its buffered rollout and the buffered mini-batches themselves."""
    return trainer._step, trainer._buffered_inputs


def set_generation_buffer(trainer: Any, step: int, buffered_inputs: Any) -> None:
    trainer._step, trainer._buffered_inputs = step, buffered_inputs


def drop_buffered_rollout(trainer: Any) -> None:
    """Make TRL generate afresh at its next step instead of reusing its buffered rollout."""
    trainer._buffered_inputs = None


def force_weight_sync(trainer: Any) -> None:
    """Make TRL's generation path think the engine's weights are stale (TRL syncs when ``_last_loaded_step`` differs
    from the global step)."""
    trainer._last_loaded_step = -1


def total_train_tokens(trainer: Any) -> int:
    """DPO's count of trained tokens (TRL logs it as ``num_tokens``)."""
    return trainer._total_train_tokens


def set_total_train_tokens(trainer: Any, count: int) -> None:
    trainer._total_train_tokens = count


# ---------------------------------------------------------------- TRL's vLLM generation object
def distributed_backend(generation: Any) -> Any:
    """The ``DistributedBackend`` TRL's ``VLLMGeneration`` gathers sharded parameters with."""
    return generation._dist


def set_weights_sleeping(generation: Any, sleeping: bool) -> None:
    """Tell TRL's ``VLLMGeneration`` whether the engine's weights are discarded (it wakes them before generating)."""
    generation._llm_weights_sleeping = sleeping
