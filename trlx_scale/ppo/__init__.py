"""PPO building blocks as pure functions and small modules: per-token rewards with a KL penalty, GAE, whitening,
the adaptive KL controller, and the critic (value model) variants."""

from .advantages import gae, kl_penalty_rewards, masked_whiten, per_token_kl
from .kl_controller import AdaptiveKLController, FixedKLController

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "gae",
    "kl_penalty_rewards",
    "masked_whiten",
    "per_token_kl",
]
