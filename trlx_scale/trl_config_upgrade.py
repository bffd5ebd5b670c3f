"""A trlx_scale config from a plain TRL one: every trainer reads its fields as typed attributes of its own config.

A trlx_scale trainer accepts TRL's own configs (``trl.GRPOConfig``, ``trl.DPOConfig``) and ``args=None``, which lack
the trlx_scale fields. The trainer turns such a config into its own config class once, at the top of ``__init__``
(``as_trlx_config``): TRL's fields keep the values TRL's ``__post_init__`` gave them (not processed again, so a user's
values stay what TRL made of them), and every trlx_scale field takes what a plain TRL config means. From then on every
component reads ``trainer.args.<field>``: one type, checked once, in the config.

What a plain TRL config means is the field's default, except where the dataclass that declares it says otherwise
(``@registers_options(plain_trl_defaults=...)``): the engine dtype and the per-request seeds, the padded rows, the
shared prefix, rank balancing and lockstep tool scheduling, so that a plain TRL config gets TRL's behaviour exactly
while a trlx_scale config gets the measured defaults. (Not in the field's metadata: transformers' argument parser
hands every metadata key to ``argparse``.) Attributes that a config's ``__post_init__`` derives from its fields
(``optim_preset_values``) are declared with their plain value (``derived=``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T", bound=type)
C = TypeVar("C")

_PLAIN_DEFAULTS = "__trlx_plain_trl_defaults__"  # a class's own fields -> what a config without them means
_DERIVED = "__trlx_derived_attributes__"  # attributes __post_init__ sets -> their value for a plain TRL config


def registers_options(derived: dict[str, Any] | None = None, plain_trl_defaults: dict[str, Any] | None = None):
    """Class decorator for a dataclass of trlx_scale fields: what a plain TRL config means for the fields it declares
    itself, where that differs from the default (``plain_trl_defaults``), and the values of the attributes its
    ``__post_init__`` derives from them (``derived``). Every field it declares needs a default."""

    def register(cls: T) -> T:
        own = set(cls.__dict__.get("__annotations__", {}))
        unknown = set(plain_trl_defaults or {}) - own
        if unknown:
            raise TypeError(f"{cls.__name__}: plain_trl_defaults names fields it does not declare: {sorted(unknown)}")
        for f in dataclasses.fields(cls):
            if f.name in own and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise TypeError(f"{cls.__name__}.{f.name}: a trlx_scale field needs a default (TRL configs lack it).")
        setattr(cls, _PLAIN_DEFAULTS, dict(plain_trl_defaults or {}))
        setattr(cls, _DERIVED, dict(derived or {}))
        return cls

    return register


def plain_trl_value(config_cls: type, name: str) -> Any:
    """What a plain TRL config means for ``config_cls``'s field ``name`` (the nearest declaration in its MRO)."""
    for klass in config_cls.__mro__:
        declared = klass.__dict__.get(_PLAIN_DEFAULTS)
        if declared is not None and name in declared:
            return declared[name]
    f = config_cls.__dataclass_fields__[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def trlx_field_names(config_cls: type, trl_cls: type) -> list[str]:
    """The fields ``config_cls`` adds to TRL's ``trl_cls``."""
    theirs = {f.name for f in dataclasses.fields(trl_cls)}
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in theirs]


def as_trlx_config(args: Any, config_cls: type[C], trl_cls: type) -> C:
    """``args`` as a ``config_cls``: itself when it is one; a plain ``trl_cls`` config becomes a ``config_cls`` holding
    its values as they are and, for every trlx_scale field, what a plain TRL config means. ``args`` is not changed."""
    if isinstance(args, config_cls):
        return args
    if not isinstance(args, trl_cls):
        raise TypeError(
            f"args must be a trlx_scale.{config_cls.__name__} or a trl.{trl_cls.__name__}, got "
            f"{type(args).__name__}: build it with trlx_scale.{config_cls.__name__}(output_dir=..., ...)."
        )
    typed = config_cls.__new__(config_cls)
    typed.__dict__.update(vars(args))  # TRL's values as its __post_init__ left them
    for name in trlx_field_names(config_cls, trl_cls):
        setattr(typed, name, plain_trl_value(config_cls, name))
    for klass in reversed(config_cls.__mro__):
        for name, value in klass.__dict__.get(_DERIVED, {}).items():
            setattr(typed, name, value)
    return typed


def trainer_config(args: Any, model: Any, config_cls: type[C], trl_cls: type, suffix: str) -> C:
    """The config a trainer runs with: ``as_trlx_config(args, ...)``; for ``args=None`` the config TRL's trainer
    builds then (``trl_cls(output_dir="<model name>-<suffix>")``), as a ``config_cls``."""
    if args is None:
        from trl.trainer.utils import get_config_model_id

        model_name = model if isinstance(model, str) else get_config_model_id(model.config)
        args = trl_cls(output_dir=f"{model_name.split('/')[-1]}-{suffix}")
    return as_trlx_config(args, config_cls, trl_cls)
