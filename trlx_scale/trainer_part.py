"""``TrainerPart``: a component a trainer holds, holding the trainer weakly in turn.

A trainer holds its parts as attributes (``trlx_scale.trainer_features``); a part reads the trainer back as
``self.trainer``. Weakly: a trainer -> part -> trainer cycle would leave a finished trainer (and its vLLM engine, and
its memory) to the cyclic garbage collector instead of freeing it when its last reference goes.
"""

from __future__ import annotations

import weakref
from typing import Any


class TrainerPart:
    """A component of ``trainer``, which it reads as ``self.trainer`` (None once the trainer is gone)."""

    def __init__(self, trainer: Any):
        self._trainer = weakref.ref(trainer)

    @property
    def trainer(self) -> Any:
        return self._trainer()
