"""TRL's rendering of tool messages, with a tokenizer other than the trainer's.

Why: ``AsyncGRPOTrainer``'s producer renders tool results on its own thread, and a Hugging Face fast tokenizer is not
thread-safe (concurrent calls fail with "Already borrowed"), so it uses a copy of the trainer's tokenizer. TRL 1.16
renders tool messages in ``GRPOTrainer._get_tool_suffix_ids`` (a dummy call conversation rendered with and without
the messages, the difference cut at the end token), which reads the tokenizer from the trainer
(``processing_class``, ``_tokenizer``) and has no tokenizer argument. Rendering it any other way risks ids that
differ from the synchronous trainer's for the same messages.

The workaround: TRL's function is called with a stand-in for the trainer that holds the copy and the trainer's chat
template settings: the attributes it reads (``TRAINER_ATTRIBUTES``). No TRL module or class is modified; text-only
(a vision-language processor is not copied for the producer).

Covered: TRL 1.16 (checked: 1.16.0). ``tests/test_compat.py`` fails when the function reads another attribute or
renders other ids than the trainer's own method.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import trl
from trl import GRPOTrainer as TRLGRPOTrainer

TESTED_TRL = ("1.16",)
# What TRL 1.16's _get_tool_suffix_ids reads from the trainer.
TRAINER_ATTRIBUTES = ("_is_vlm", "processing_class", "_tokenizer", "chat_template", "chat_template_kwargs")


def supported() -> bool:
    """Whether this TRL is one whose ``_get_tool_suffix_ids`` this module was checked against."""
    return trl.__version__.startswith(TESTED_TRL)


def tool_suffix_renderer(trainer: Any, tokenizer: Any) -> Callable[[list[dict[str, Any]]], list[int]]:
    """``messages -> ids``: TRL's ``_get_tool_suffix_ids`` of ``trainer``, rendered by ``tokenizer`` (a copy of the
    trainer's) instead of the trainer's own."""
    if not supported():
        raise RuntimeError(
            f"trlx_scale renders tool messages off the trainer's thread through TRL 1.16's _get_tool_suffix_ids; TRL "
            f"{trl.__version__} is not checked. Install the TRL version pyproject.toml pins."
        )
    if trainer._is_vlm:
        raise ValueError("tool messages are rendered off the trainer's thread for text models only, not processors.")
    stand_in = SimpleNamespace(
        _is_vlm=False,
        processing_class=tokenizer,
        _tokenizer=tokenizer,
        chat_template=trainer.chat_template,
        chat_template_kwargs=dict(trainer.chat_template_kwargs),
    )
    return functools.partial(TRLGRPOTrainer._get_tool_suffix_ids, stand_in)
