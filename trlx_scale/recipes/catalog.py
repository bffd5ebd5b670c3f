"""Reading recipe files (see the package docstring for their layout)."""

from __future__ import annotations

import importlib.resources as resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COMMANDS = ("grpo", "ppo", "dpo")
REQUIRED = ("description", "command", "hardware", "accelerate_config", "model_shape", "expected_gib_per_gpu")


@dataclass
class Recipe:
    """One recipe: ``meta`` (the ``recipe`` block) and ``config`` (what the training script reads)."""

    name: str
    path: str
    meta: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def command(self) -> str:
        return self.meta["command"]

    @property
    def hardware(self) -> dict[str, Any]:
        return self.meta["hardware"]

    def launch_line(self) -> str:
        """The command that runs it on its hardware."""
        line = f"trlx-scale {self.command} --recipe {self.name} --accelerate_config {self.meta['accelerate_config']}"
        if self.hardware.get("nodes", 1) > 1:
            line += " --machine_rank $NODE_RANK --main_process_ip $MAIN_NODE_IP"
        return line


def recipe_names() -> list[str]:
    folder = resources.files("trlx_scale.recipes")
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def recipe_path(name_or_path: str) -> str:
    if Path(name_or_path).is_file():
        return name_or_path
    candidate = resources.files("trlx_scale.recipes").joinpath(f"{name_or_path}.yaml")
    if not candidate.is_file():
        raise ValueError(f"--recipe {name_or_path}: no such recipe; `trlx-scale recipes` lists {recipe_names()}.")
    return str(candidate)


def is_recipe(document: Any) -> bool:
    return isinstance(document, dict) and set(document) == {"recipe", "config"}


def load_recipe(name_or_path: str) -> Recipe:
    import yaml

    path = recipe_path(name_or_path)
    with open(path) as handle:
        document = yaml.safe_load(handle)
    name = Path(path).stem
    if not is_recipe(document):
        raise ValueError(f"{path}: a recipe has exactly two blocks, 'recipe' and 'config'.")
    meta, config = document["recipe"], document["config"] or {}
    missing = [key for key in REQUIRED if key not in meta]
    if missing:
        raise ValueError(f"{path}: the 'recipe' block lacks {missing}.")
    if meta["command"] not in COMMANDS:
        raise ValueError(f"{path}: recipe.command must be one of {COMMANDS}, got {meta['command']!r}.")
    return Recipe(name=name, path=path, meta=meta, config=dict(config))
