"""Input checks that need the data or the engine, not just the config: run before the first step, or at the first
batch that reveals the problem (a dataset is never scanned ahead: it may be streamed or huge)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any


def check_train_dataset(dataset: Any, field: str = "train_dataset") -> None:
    """An empty dataset would end training at step 0 with a bare message (or divide by zero in the schedule)."""
    if dataset is None:
        return
    try:
        rows = len(dataset)
    except TypeError:  # an IterableDataset has no length: nothing to check before streaming it
        return
    if rows == 0:
        raise ValueError(
            f"{field} is empty (0 rows). Check the dataset split and any filter applied to it (a --train_size of 0, "
            "a length filter that dropped every row)."
        )


# The columns each trainer reads, as alternatives (any one set suffices). The values of 'prompt', 'chosen' and
# 'rejected' are plain strings or conversations (lists of {"role", "content"} messages); TRL accepts both.
GRPO_COLUMNS = (("prompt",),)
DPO_COLUMNS = (
    ("prompt", "chosen", "rejected"),  # explicit prompt
    ("chosen", "rejected"),  # implicit prompt: TRL extracts the shared start of chosen and rejected
    ("prompt_ids", "chosen_ids", "rejected_ids"),  # already tokenized
)
ONLINE_DPO_COLUMNS = (("prompt",),)
# Names datasets on the Hub commonly use for what these trainers call a prompt.
_PROMPT_LIKE = ("question", "query", "problem", "instruction", "input", "messages", "conversations", "text")


def _column_names(dataset: Any) -> list[str] | None:
    names = getattr(dataset, "column_names", None)
    if names is None and getattr(dataset, "features", None) is not None:
        names = list(dataset.features)
    return list(names) if names is not None else None


def check_dataset_columns(dataset: Any, needs: Sequence[Sequence[str]], trainer: str, field: str = "train_dataset"):
    """Refuse, before the first step, a dataset that lacks the columns ``trainer`` reads (else a bare ``KeyError:
    'prompt'`` at the first batch). ``needs``: alternative column sets. A dict of datasets (several eval sets) is
    checked one by one; a dataset whose columns are unknown (a streamed one without features) is not checked."""
    if dataset is None:
        return
    if isinstance(dataset, dict):
        for name, part in dataset.items():
            check_dataset_columns(part, needs, trainer, f"{field}[{name!r}]")
        return
    found = _column_names(dataset)
    if found is None or any(set(columns) <= set(found) for columns in needs):
        return
    wanted = " or ".join("(" + ", ".join(repr(c) for c in columns) + ")" for columns in needs)
    hint = ""
    prompt_like = [name for name in _PROMPT_LIKE if name in found]
    if any("prompt" in columns for columns in needs) and prompt_like and "prompt" not in found:
        hint = (
            f" To use {prompt_like[0]!r} as the prompt: dataset = dataset.rename_column({prompt_like[0]!r}, 'prompt')."
        )
    raise ValueError(
        f"{field} has the columns {found}, but {trainer} reads {wanted}. Each value is plain text or a conversation "
        f"(a list of {{'role': ..., 'content': ...}} messages); other columns are passed to the reward functions.{hint}"
    )


def check_launch_matches(args: Any) -> None:
    """A launcher that started several processes must get a process group of that size. On a machine without a GPU,
    Accelerate forms one only with ``use_cpu=True`` (gloo; DeepSpeed with ``ddp_backend="gloo"``); without it every
    process believes it is alone: its gathers are no-ops, it trains on its own share with its own weights, and all of
    them write the same output_dir. Nothing fails; the run is silently wrong. ``args``: the trainer's config."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched <= 1:
        return
    formed = args.world_size  # Accelerate's process count (this sets up the distributed state)
    if formed != launched:
        raise ValueError(
            f"The launcher started {launched} processes (WORLD_SIZE={launched}) but Accelerate set up {formed}: each "
            "would train alone. On a machine without a GPU set use_cpu=True and ddp_backend='gloo' in the config "
            "(under DeepSpeed, ddp_backend='gloo' only); trlx_scale.tasks.example_runtime.cpu_launch_defaults() "
            "returns them."
        )


def check_prompts_fit_context(prompts: Sequence[Sequence[int]], max_completion_length: int, context: int) -> None:
    """Each prompt plus the completion budget must fit the engine's context: vLLM refuses a longer prompt mid-run,
    and a shorter margin cuts completions before max_completion_length, which the rewards then score as finished."""
    if not prompts:
        return
    row, longest = max(enumerate(len(p) for p in prompts), key=lambda item: item[1])
    if longest + max_completion_length > context:
        raise ValueError(
            f"A prompt of {longest} tokens (row {row} of this batch) plus max_completion_length="
            f"{max_completion_length} exceeds the engine's context of {context} tokens (vllm_max_model_length). Raise "
            f"vllm_max_model_length to at least {longest + max_completion_length} (within the model's "
            "max_position_embeddings), drop or shorten long prompts (e.g. dataset.filter on the prompt's token "
            "count), or lower max_completion_length."
        )
