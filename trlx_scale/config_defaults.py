"""Filling config fields that the user left at their defaults (optimizer presets, loss recipes)."""

from __future__ import annotations

import dataclasses
from typing import Any


def fill_unset_fields(config: Any, values: dict[str, Any], source: str) -> dict[str, tuple[Any, str]]:
    """Set each field of ``values`` on ``config`` when it still equals its class default.

    A field counts as set by the user when its value differs from the default (a dataclass cannot tell an explicit
    default from an omitted one). Returns ``{field: (effective value, source | "user")}`` for the start-up log.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(type(config))}
    effective = {}
    for name, value in values.items():
        if getattr(config, name) == defaults[name]:
            setattr(config, name, value)
            effective[name] = (value, source)
        else:
            effective[name] = (getattr(config, name), "user")
    return effective
