"""The trlx_scale section of a model card: the settings that were on, the final metrics, held-out accuracy.

TRL's card names the trainer (``_name``) and its paper (``_paper``); this section adds what a reader of the card
needs to reproduce or judge the run, from the config and the run's own records (``trainer_state`` log history and
the examples' ``run_summary.json``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SECTION_TITLE = "## trlx_scale"
# Training-log keys worth a line on the card (when logged), in this order.
FINAL_METRICS = (
    "loss",
    "reward",
    "reward_std",
    "ppo/kl",
    "ppo/value_loss",
    "rewards/accuracies",
    "rewards/margins",
    "grad_norm",
    "reliability/skipped_steps",
)


def _trl_base(config_cls: type) -> type | None:
    """The first class of ``config_cls``'s MRO that TRL defines: the fields it does not have are trlx_scale's."""
    return next((c for c in config_cls.__mro__ if c.__module__.startswith("trl.")), None)


def trlx_scale_settings(args: Any) -> dict[str, Any]:
    """trlx_scale's config fields whose value differs from the default, plus the engine (TRL's use_vllm/vllm_mode)."""
    if not dataclasses.is_dataclass(args):
        return {}
    base = _trl_base(type(args))
    base_fields = {f.name for f in dataclasses.fields(base)} if base is not None else set()
    settings: dict[str, Any] = {}
    if getattr(args, "use_vllm", False):
        settings["use_vllm"] = True
        settings["vllm_mode"] = getattr(args, "vllm_mode", None)
    for field in dataclasses.fields(args):
        if field.name in base_fields or field.name.startswith("_"):
            continue
        default = field.default if field.default is not dataclasses.MISSING else None
        value = getattr(args, field.name, default)
        if value != default:
            settings[field.name] = value
    return settings


def _final_metrics(log_history: list[dict]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for entry in log_history:
        if "loss" not in entry:
            continue
        for key in FINAL_METRICS:
            value = entry.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                metrics[key] = float(value)
    return metrics


def trlx_scale_card_section(trainer_name: str, args: Any, log_history: list[dict], global_step: int) -> str:
    """Markdown: the trainer, the settings that were on, the final metrics and (if the run measured it) held-out
    accuracy before and after."""
    lines = [SECTION_TITLE, "", f"Trained with trlx_scale's `{trainer_name}Trainer` for {global_step} steps.", ""]
    settings = trlx_scale_settings(args)
    lines += ["Settings that were on (trlx_scale fields not at their defaults):", ""]
    lines += [f"- `{name}`: `{value}`" for name, value in settings.items()] or ["- none (TRL's behaviour)"]
    metrics = _final_metrics(log_history)
    if metrics:
        lines += ["", "Final training metrics (last logged step):", "", "| metric | value |", "|---|---|"]
        lines += [f"| {key} | {value:.6g} |" for key, value in metrics.items()]
    summary_path = os.path.join(args.output_dir, "run_summary.json")
    if os.path.isfile(summary_path):
        with open(summary_path) as handle:
            summary = json.load(handle)
        before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
        if after is not None:
            lines += ["", f"Held-out accuracy: {_percent(before)} before training, {_percent(after)} after."]
    return "\n".join(lines) + "\n"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"
