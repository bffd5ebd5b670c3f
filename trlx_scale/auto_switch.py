"""How a trlx_scale setting of on / auto / off becomes on or off, and where it is parsed.

The optimizations a run can only take where the model and the layout allow them (``shared_prefix``,
``padding_free``, ``balance_ranks``, ``recompute_forwards``) share one rule: off is off; otherwise the blocker is
asked why the run cannot take it; on with a reason is an error naming the field and the fix, auto with a reason is
off with the reason logged once. The settings are ``"true"`` / ``"auto"`` / ``"false"``, or, for ``padding_free``
(a bool in TRL's DPOConfig), ``True`` / ``None`` / ``False``: ``switch_value`` reads either spelling.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers.utils import logging

logger = logging.get_logger(__name__)

_SPELLINGS: dict[object, bool | None] = {
    "true": True,
    "false": False,
    "auto": None,
    True: True,
    False: False,
    None: None,
}


def switch_value(field: str, setting: object) -> bool | None:
    """``setting`` of ``field`` as True (on), False (off) or None (auto); an error naming the field otherwise."""
    key = setting.lower() if isinstance(setting, str) else setting
    try:
        return _SPELLINGS[key]
    except (KeyError, TypeError):
        raise ValueError(
            f"{field} must be on, off or auto ('true' / 'false' / 'auto', or True / False / None), got {setting!r}."
        ) from None


SWITCH_SETTINGS = ("auto", "true", "false")


def switch_setting(field: str, setting: object, hint: str) -> str:
    """A string switch field's setting, checked once in its config: "auto", "true" or "false" (a bool is read as its
    string); an error naming the field, its settings and ``hint`` (what "auto" does) otherwise."""
    if isinstance(setting, bool):
        return "true" if setting else "false"
    if isinstance(setting, str) and setting.lower() in SWITCH_SETTINGS:
        return setting.lower()
    raise ValueError(f"{field} must be one of {SWITCH_SETTINGS}, got {setting!r}: {hint}.")


def resolve_switch(field: str, setting: object, blocker: Callable[[], str | None]) -> tuple[bool, str | None]:
    """(on, why off) for ``field`` set to ``setting``; ``blocker`` is asked only when the setting is not off."""
    value = switch_value(field, setting)
    if value is False:
        return False, f"{field}={setting!r}"
    reason = blocker()
    if reason is None:
        return True, None
    if value is True:
        fix = f"{field}='auto' or 'false'" if isinstance(setting, str) else f"{field}=None (auto) or False"
        raise ValueError(f"{field}={setting!r} cannot run: {reason}. Set {fix}.")
    logger.warning("%s=%r is off: %s.", field, setting, reason)
    return False, reason
