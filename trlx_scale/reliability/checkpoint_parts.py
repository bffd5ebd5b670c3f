"""The named pieces of trainer state a checkpoint holds beside transformers' own, in one registry.

transformers saves the model, the optimizer, the scheduler, the RNG states and ``TrainerState``. A trlx_scale trainer
has more that an exact resume needs: the policy version, TRL's generation buffer inside a rollout's mini-batches,
PPO's critic and KL coefficient, DPO's token count, the asynchronous trainer's rollout window. Each is a
``CheckpointPart``, built by the component that owns the state and registered under a name on the trainer's
``checkpoint_parts``; the atomic checkpoint feature (``reliability.checkpoints``) saves every part, in registration
order, before it writes the completion marker, and loads them in the same order when a run resumes.

A part saves itself: it knows whether its state is the same on every rank (written by the main process) or each
rank's own (a file per rank), and which format keeps it (JSON for counters a person may read, ``torch.save`` for
tensors). ``save`` runs on every rank, since a part may need a collective (PPO's ZeRO-3 critic gathers).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class CheckpointPart(Protocol):
    """One named piece of checkpoint state (torch's ``Stateful``, with the files in the part's hands)."""

    def save(self, checkpoint_dir: str) -> None:
        """Write this part into ``checkpoint_dir`` (called on every rank, before the completion marker)."""

    def load(self, checkpoint_dir: str) -> None:
        """Restore this part from ``checkpoint_dir`` (called on every rank when a run resumes from it)."""


class CheckpointParts:
    """The trainer's registry of ``CheckpointPart``s, saved and loaded in the order they were registered."""

    def __init__(self) -> None:
        self._parts: dict[str, CheckpointPart] = {}

    def register(self, name: str, part: CheckpointPart) -> None:
        if name in self._parts:
            raise ValueError(f"a checkpoint part named {name!r} is registered already: each piece of state once.")
        if not isinstance(part, CheckpointPart):
            raise TypeError(f"checkpoint part {name!r} needs save(checkpoint_dir) and load(checkpoint_dir).")
        self._parts[name] = part

    def names(self) -> list[str]:
        return list(self._parts)

    def save(self, checkpoint_dir: str) -> None:
        for part in self._parts.values():
            part.save(checkpoint_dir)

    def load(self, checkpoint_dir: str) -> None:
        for part in self._parts.values():
            part.load(checkpoint_dir)
