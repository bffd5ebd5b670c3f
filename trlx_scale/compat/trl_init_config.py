"""The config TRL's ``__init__`` is handed, where it must not act on one of the user's settings.

Why: TRL 1.16's trainers act on some fields inside ``__init__`` with no hook to stop them. ``GRPOTrainer`` starts its
own vLLM engine (colocate) or client (server) when ``use_vllm`` is on, and two engines must never start: trlx_scale
builds its own (``generation``). ``DPOTrainer`` reads its own ``padding_free`` (a bool) and warns that it is
disabled, where trlx_scale packs the rows itself (``passes``); online DPO needs the prompt-only rows to reach the
training step untouched (``remove_unused_columns``); a reward column trlx_scale appends (DAPO's overlong penalty)
needs its weight in ``reward_weights``, which TRL checks against the functions and turns into a tensor there. Each trainer hands TRL a copy with those fields switched, through
this one function, and reads the user's values afterwards: the caller's config object is never changed.

Covered: TRL 1.16 (checked: 1.16.0). ``tests/test_trl_contract.py`` fails when TRL's ``__init__`` stops reading a
field this switches (then the switch can go).
"""

from __future__ import annotations

import copy
from typing import Any

TESTED_TRL = ("1.16",)

# The fields a trainer may switch for TRL's __init__, and why (each pinned by a contract test).
SWITCHABLE = {
    "use_vllm": "TRL starts its own vLLM engine or client in __init__; trlx_scale builds its own",
    "padding_free": "TRL's DPO reads its own bool and warns; trlx_scale packs the rows itself",
    "remove_unused_columns": "online DPO's prompt-only rows reach the training step with their columns",
    "reward_weights": "a reward column trlx_scale appends (overlong_penalty) needs its weight in TRL's check and tensor",
}


def config_for_trl_init(args: Any, **switched: Any) -> Any:
    """A shallow copy of ``args`` with ``switched`` set, for TRL's ``__init__`` only (``args`` itself unchanged)."""
    unknown = set(switched) - set(SWITCHABLE)
    if unknown:
        raise ValueError(f"config_for_trl_init switches only {sorted(SWITCHABLE)}, not {sorted(unknown)}.")
    trl_args = copy.copy(args)
    for name, value in switched.items():
        setattr(trl_args, name, value)
    return trl_args
