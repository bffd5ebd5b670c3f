"""The decoupled off-policy objective (AReaL's decoupled PPO) as pure tensor functions: the reference the
asynchronous trainer's loss is held to (``tests/test_async_grpo.py``), not a training path.

What trains is TRL's loss with its vLLM importance-sampling correction, the weights from
``trlx_scale/losses/vllm_importance_sampling.py`` (the package's one place for them); these functions state the
objective from its definition, so the tests can say the trainer computes it.

With asynchronous generation a sample is drawn by the behaviour policy pi_behave (the weights the server held, up to
``max_staleness`` versions old, run by the engine's kernels) and trained by pi_theta. The plain clipped surrogate
with pi_behave in the ratio's denominator clips against a policy several steps away: the trust region is wrong and
the ratios blow up (reported from staleness 3 on). The decoupled objective splits the two roles:

    loss_t = -w_t * min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)
    r_t = pi_theta(y_t) / pi_prox(y_t)          the trust region, around the proximal policy
    w_t = pi_prox(y_t) / pi_behave(y_t)         the off-policy correction, no gradient

pi_prox is the trainer's policy before this step's update (what TRL's old-policy pass computes), and pi_behave the
engine's log-probs of the sampled tokens. The weight is bounded: "truncate" caps it at ``cap`` (truncated importance
sampling: bias for variance), "mask" drops tokens whose weight exceeds ``cap`` (no bias from the kept ones, fewer
tokens). At level "sequence" (GSPO) the weight is one per sequence, the geometric mean over its tokens,
exp(mean_t(log pi_prox - log pi_behave)): the same length normalisation as GSPO's ratio, so a long sequence's weight
does not explode as the product of its token weights would.

With an unchanged policy and an exact engine (pi_prox == pi_behave) every weight is 1 and the loss is the plain
clipped surrogate (``policy_loss_reference.clipped_policy_loss``). Shapes as in ``policy_losses``: (B, T) log-probs and
mask, (B,) advantages.
"""

from __future__ import annotations

import torch

from trlx_scale.losses.vllm_importance_sampling import behaviour_kl

from .policy_loss_reference import clipped_policy_loss

WEIGHT_LEVELS = ("token", "sequence")
WEIGHT_MODES = ("truncate", "mask")


def behaviour_weights(
    prox_logps: torch.Tensor,
    behave_logps: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights pi_prox / pi_behave ((B, T) for "token", (B, 1) for "sequence"), bounded by ``cap``, without
    gradient; and the fraction of the real tokens (or sequences) whose weight the bound changed."""
    if level not in WEIGHT_LEVELS:
        raise ValueError(f"behaviour weight level must be one of {WEIGHT_LEVELS}, got {level!r}.")
    if mode not in WEIGHT_MODES:
        raise ValueError(f"behaviour weight mode must be one of {WEIGHT_MODES}, got {mode!r}.")
    if not cap >= 1.0:
        raise ValueError(f"the behaviour weight cap must be at least 1 (1 keeps no off-policy token), got {cap}.")
    mask = mask.to(prox_logps.dtype)
    log_weight = _masked_log_ratio(prox_logps, behave_logps, mask)
    if level == "sequence":
        log_weight = (log_weight.sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    weight = torch.exp(log_weight)
    over = weight > cap
    bounded = weight.clamp(max=cap) if mode == "truncate" else weight.masked_fill(over, 0.0)
    if level == "sequence":
        counted = (mask.sum(-1, keepdim=True) > 0).to(mask.dtype)
        fraction = (over.to(mask.dtype) * counted).sum() / counted.sum().clamp(min=1.0)
    else:
        fraction = (over.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1.0)
    return bounded, fraction


def _masked_log_ratio(prox_logps: torch.Tensor, behave_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log pi_prox - log pi_behave on the real tokens, 0 elsewhere, without gradient. Selected, not multiplied by the
    mask: the engine's log-probs of padding (or of a token it could not score) may be NaN, and NaN * 0 is NaN."""
    return torch.where(mask.bool(), (prox_logps - behave_logps).detach(), torch.zeros_like(prox_logps))


def decoupled_policy_loss(
    logps: torch.Tensor,
    prox_logps: torch.Tensor,
    behave_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    ratio_level: str = "token",
    weight_mode: str = "truncate",
    weight_cap: float = 2.0,
    aggregation: str = "sequence_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The decoupled clipped surrogate (module docstring): the trust region around pi_prox at ``ratio_level``
    ("token", or "sequence" for GSPO, whose behaviour weight is then per sequence too), times the bounded behaviour
    weight. Returns the loss and its statistics: the clip fractions, the weight's bound fraction and the KL."""
    weight_level = "sequence" if ratio_level == "sequence" else "token"
    weights, bounded_fraction = behaviour_weights(
        prox_logps, behave_logps, mask, level=weight_level, mode=weight_mode, cap=weight_cap
    )
    # The weight multiplies each token's (or sequence's) surrogate; folded into the mask instead, it would change
    # the aggregation's normaliser and GSPO's sequence mean.
    loss, stats = clipped_policy_loss(
        logps,
        prox_logps.detach(),  # the proximal policy is a fixed reference, like TRL's old log-probs
        advantages,
        mask,
        epsilon_low,
        epsilon_high,
        level=ratio_level,
        aggregation=aggregation,
        weights=weights,
    )
    stats["behaviour_weight_clip_frac"] = bounded_fraction
    stats["behaviour_kl"] = behaviour_kl(prox_logps, behave_logps, mask)
    return loss, stats
