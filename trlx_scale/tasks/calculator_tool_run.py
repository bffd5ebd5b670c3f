"""``--task calculator_tools`` of ``trlx-scale grpo`` and ``trlx-scale async_grpo``: the embedded agentic task.

The embedded tool model (``tool_model``) on sums of three three-digit numbers (``calculator_task``), trained with
``tools=[add]`` and an exact-answer reward; held-out accuracy is scored greedily with the tool executed, as it is
used in training (``evaluate_with_tool``). ``run_example`` asks this module for the task's defaults, data, trainer
arguments and accuracy; everything else (flags, saving, the summary, the Hub) is the examples' own path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trl.models import unwrap_model_for_generation

ADDITION = "addition"
CALCULATOR_TOOLS = "calculator_tools"
EMBEDDED_TASKS = (ADDITION, CALCULATOR_TOOLS)
DATASET_LABEL = "trlx_scale/calculator_tools"

# The settings that learn on 2 cores (docs/benchmarks.md, "Learning with tools": 60% -> 99-100% held-out accuracy in
# 30 steps over three seeds): full fine-tuning (the tool model is 0.4M parameters), one tool round (a call, its
# result, the answer: about 80 tokens of completion), 64 completions per step in groups of 8, and a context that holds
# the prompt and the whole trajectory. They replace the addition task's (LoRA, 6-token completions); the command line
# and a --config file still override each.
CALCULATOR_TOOL_DEFAULTS: dict[str, Any] = dict(
    use_peft=False,
    learning_rate=2e-4,
    warmup_steps=3,
    max_steps=30,
    per_device_train_batch_size=64,
    num_generations=8,
    max_completion_length=100,
    max_tool_calling_iterations=1,
    vllm_max_model_length=256,
    logging_steps=5,
    eval_size=200,
)


def check_task(task: str, takes_tools: bool, trainer_name: str, dataset_name: str | None) -> None:
    """Refuse a task the command cannot run, naming the flag and the fix (``takes_tools``: the example's trainer
    trains with tools, ``Example.takes_tools``)."""
    if task not in EMBEDDED_TASKS:
        raise ValueError(f"--task must be one of {EMBEDDED_TASKS}, got {task!r}.")
    if task != CALCULATOR_TOOLS:
        return
    if dataset_name is not None:
        raise ValueError(
            f"--task {CALCULATOR_TOOLS} is an embedded task and --dataset_name {dataset_name!r} names another: pass "
            "one of them."
        )
    if not takes_tools:
        raise ValueError(
            f"--task {CALCULATOR_TOOLS} trains with tools, which this command's {trainer_name} does not: run it "
            "with `trlx-scale grpo` or `trlx-scale async_grpo`."
        )


# AsyncGRPOTrainer on this task (docs/benchmarks.md, "Learning with tools"): at max_staleness=1 (the async
# example's default) held-out accuracy went 60% -> 94.0%, 45.5% and 99.5% over seeds 42, 1 and 2 (seed 1 learned to
# call the tool less), in 100-110 s of training; at 0 it went to 100%, 100% and 96.0%, in 88-90 s: the tool answers
# in milliseconds, so there is no latency for staleness to hide, and trainer and server share the 2 cores.
ASYNC_CALCULATOR_TOOL_DEFAULTS: dict[str, Any] = dict(max_staleness=0)


def task_defaults(config_cls: type) -> dict[str, Any]:
    """The task's defaults for a trainer of config ``config_cls``, the embedded tool model included."""
    from .tool_model import tool_model_path

    defaults = {"model_name_or_path": tool_model_path(), **CALCULATOR_TOOL_DEFAULTS}
    if "max_staleness" in {field.name for field in dataclasses.fields(config_cls)}:
        defaults.update(ASYNC_CALCULATOR_TOOL_DEFAULTS)
    return defaults


def task_data(train_size: int | None, eval_size: int) -> tuple[Any, list]:
    """(the training prompts as a dataset with an "answer" column, the held-out problems)."""
    from .calculator_task import calculator_dataset, calculator_problems

    if eval_size <= 0:
        raise ValueError(f"--eval_size must be at least 1 with --task {CALCULATOR_TOOLS}, got {eval_size}.")
    return calculator_dataset("train", size=train_size), calculator_problems("held_out", size=eval_size)


def task_trainer_kwargs(model_name_or_path: str) -> dict[str, Any]:
    """The trainer's tools and the tokenizer with the tool templates (the one the model was trained with)."""
    from .calculator_task import add
    from .tool_model import load_tool_model_tokenizer

    return {"tools": [add], "processing_class": load_tool_model_tokenizer(model_name_or_path)}


def task_reward_functions() -> list:
    from .calculator_task import exact_answer

    return [exact_answer]


def held_out_tool_accuracy(trainer, problems: list) -> float:
    """Greedy accuracy with the tool executed (every process takes part: under ZeRO-3 the forward gathers weights);
    the main process prints how often the tool was called and how accurate each way of answering was."""
    from .tool_model import evaluate_with_tool, format_evaluation

    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
        result = evaluate_with_tool(model, trainer.processing_class, problems)
    if trainer.accelerator.is_main_process:
        print(f"held-out at step {trainer.state.global_step}: {format_evaluation(result)}", flush=True)
    return result["accuracy"]
