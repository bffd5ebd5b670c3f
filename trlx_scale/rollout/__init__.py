"""What a rollout is, between the engine and the loss: ``RolloutBatch`` (the typed batch every algorithm's rollout
produces) and the policy version that tags it (``policy_version``)."""

from .batch import RolloutBatch

__all__ = ["RolloutBatch"]
