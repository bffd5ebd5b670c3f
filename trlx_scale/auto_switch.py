"""``resolve_switch``: how a trlx_scale setting of "true" / "auto" / "false" becomes on or off.

The optimizations a run can only take where the model and the layout allow them (``shared_prefix``,
``padding_free``) share one rule: "false" is off; otherwise the blocker is asked why the run cannot take it; "true"
with a reason is an error naming the field and the fix, "auto" with a reason is off with the reason logged once.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers.utils import logging

logger = logging.get_logger(__name__)


def resolve_switch(field: str, setting: str, blocker: Callable[[], str | None]) -> tuple[bool, str | None]:
    """(on, why off) for ``field`` set to ``setting``; ``blocker`` is asked only when the setting is not "false"."""
    if setting == "false":
        return False, f"{field}='false'"
    reason = blocker()
    if reason is None:
        return True, None
    if setting == "true":
        raise ValueError(f"{field}='true' cannot run: {reason}. Set {field}='auto' or 'false'.")
    logger.warning("%s='auto' is off: %s.", field, reason)
    return False, reason
