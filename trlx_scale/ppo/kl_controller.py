"""KL coefficient controllers for the per-token KL penalty (Ziegler et al. 2019, "Fine-Tuning Language Models from
Human Preferences", section 2.2)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


@dataclass
class AdaptiveKLController:
    """Proportional control of the KL coefficient towards a target KL.

    error = clip(KL / target - 1, -0.2, 0.2);  coef <- coef * (1 + error * n_steps / horizon),
    where KL is the batch mean of the per-sequence KL and ``n_steps`` the number of sequences it was measured on.
    """

    value: float = 0.2
    target: float = 6.0
    horizon: int = 10000

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value
