"""``option(args, name)``: the one way every trlx_scale component reads a trlx_scale config field.

A trlx_scale trainer accepts TRL's own configs (``trl.GRPOConfig``, ``trl.DPOConfig``), which lack the trlx_scale
fields. Every component reads those fields through ``option``: the value on the config when it has the field, else
the field's default, declared once, where the field is (``@registers_options`` on the dataclass that declares it).

A field whose meaning for a plain TRL config differs from its trlx_scale default says so where it is declared
(``plain_trl_defaults=``): the engine dtype and the per-request seeds, so that a plain TRL config gets TRL's engine
exactly, while a trlx_scale config gets the measured defaults. (Not in the field's metadata: transformers' argument
parser hands every metadata key to ``argparse``.)

Derived values (properties of the field classes, e.g. ``uses_fp32_master_weights``) are registered with the value a
plain TRL config means (``derived=``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T", bound=type)

_DEFAULTS: dict[str, Any] = {}  # field name -> what a config without the field means
_OWNERS: dict[str, str] = {}  # field name -> the class that declares it (for error messages)


def registers_options(derived: dict[str, Any] | None = None, plain_trl_defaults: dict[str, Any] | None = None):
    """Class decorator for a dataclass of trlx_scale fields: registers the defaults of the fields it declares itself
    (inherited ones, TRL's included, are not trlx_scale's), what a plain TRL config means where that differs
    (``plain_trl_defaults``), and the values ``derived`` from the fields (properties) mean for a plain TRL config."""

    def register(cls: T) -> T:
        own = set(cls.__dict__.get("__annotations__", {}))
        unknown = set(plain_trl_defaults or {}) - own
        if unknown:
            raise TypeError(f"{cls.__name__}: plain_trl_defaults names fields it does not declare: {sorted(unknown)}")
        for f in dataclasses.fields(cls):
            if f.name not in own:
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                raise TypeError(f"{cls.__name__}.{f.name}: a trlx_scale field needs a default (TRL configs lack it).")
            _DEFAULTS[f.name] = (plain_trl_defaults or {}).get(f.name, default)
            _OWNERS[f.name] = cls.__name__
        for name, value in (derived or {}).items():
            _DEFAULTS[name] = value
            _OWNERS[name] = cls.__name__
        return cls

    return register


def option(args: Any, name: str) -> Any:
    """``args.<name>`` when the config has it, else what its absence means (the registered default).

    ``args`` may be None (a trainer built without a config): every option then has its default."""
    if name not in _DEFAULTS:
        # Importing the configs registers every field; a component that reads an option is used by a trainer,
        # whose module imported them already, so this only triggers for a misspelt name.
        raise KeyError(f"{name!r} is not a trlx_scale config field (known: {', '.join(sorted(_DEFAULTS))}).")
    if args is not None and hasattr(args, name):
        return getattr(args, name)
    return _DEFAULTS[name]


def registered_options() -> dict[str, str]:
    """Every registered field or derived value and the class that declares it (for tests and docs)."""
    return dict(_OWNERS)
