"""vLLM's importance-sampling correction (TRL's ``vllm_importance_sampling_correction``) from given log-probs.

vLLM samples a batch with its own numerics; the trainer's log-probs of the same tokens differ slightly (precision,
kernels) or a lot (a stale engine). TRL corrects for it by weighting each token's loss with
``exp(old - sampling)`` (per token, or summed per sequence), truncated or masked to
``[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max]``, and logs the gap and the ratios.

TRL computes this inline in ``_generate_and_score_completions``, from an extra old-policy pass over the whole batch.
``GRPOTrainer`` computes the same quantities in the loss pass when that pass runs with the weights that generated the
batch (``old_logprobs_from_loss_pass``): the loss pass's detached log-probs are then the old log-probs. The formulas
here follow TRL 1.16's lines; ``tests/test_old_logprobs_from_loss_pass.py`` checks them against TRL's own path.
"""

from __future__ import annotations

import math

import torch

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# A sequence's weight from its tokens' log-ratios: TRL's product ("sum": exp of their sum) or GSPO's geometric mean
# ("mean": exp of their mean, the length normalisation of GSPO's own ratio).
SEQUENCE_NORMALISATIONS = ("sum", "mean")


def is_sequence_level(mode: str) -> bool:
    return mode in ("sequence_truncate", "sequence_mask")


def unbounded_log_weights(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    sequence_normalisation: str = "sum",
) -> torch.Tensor:
    """log(pi_old / pi_sampling) before the clip bounds: per token ((B, T)), or per sequence ((B, 1)) as the sum or
    the mean of its tokens' (``sequence_normalisation``). A token vLLM could not score (NaN) counts 0."""
    if sequence_normalisation not in SEQUENCE_NORMALISATIONS:
        raise ValueError(
            f"sequence_normalisation must be one of {SEQUENCE_NORMALISATIONS}, got {sequence_normalisation!r}."
        )
    difference = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if is_sequence_level(mode):
        difference = difference.sum(dim=-1, keepdim=True)
        if sequence_normalisation == "mean":
            difference = difference / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    return difference


def vllm_importance_sampling_ratio(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
    sequence_normalisation: str = "sum",
) -> torch.Tensor:
    """The correction weights: (B, T) for token modes, (B, 1) for sequence modes. ``mask``: the completion tokens
    (times the tool mask). A token vLLM could not score (NaN) gets a zero difference: ratio 1, no correction.
    ``sequence_normalisation``: a sequence mode's weight is the product of its token ratios ("sum", TRL's) or
    their geometric mean ("mean")."""
    if mode not in MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {MODES}, got {mode!r}.")
    ratio = torch.exp(unbounded_log_weights(old_logps, sampling_logps, mask, mode, sequence_normalisation))
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def importance_sampling_statistics(
    old_logps: torch.Tensor, sampling_logps: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor, mode: str
) -> dict[str, torch.Tensor]:
    """This rank's statistics, as TRL logs them (before its gathers): the mean and max absolute log-prob gap over the
    scored completion tokens, and the min/mean/max ratio (over tokens, or sequences in a sequence mode). An empty
    selection gives 0."""
    mask = mask.bool()
    delta = torch.abs(old_logps - sampling_logps)
    delta = delta[mask & ~torch.isnan(delta)]
    ratios = ratio.flatten() if is_sequence_level(mode) else ratio[mask]
    zero = torch.tensor(0.0, device=old_logps.device)

    def reduce(values: torch.Tensor, how) -> torch.Tensor:
        return how(values) if values.numel() > 0 else zero

    return {
        "gap_mean": reduce(delta, torch.mean),
        "gap_max": reduce(delta, torch.max),
        "ratio_min": reduce(ratios, torch.min),
        "ratio_mean": reduce(ratios, torch.mean),
        "ratio_max": reduce(ratios, torch.max),
    }


def behaviour_kl(prox_logps: torch.Tensor, behave_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(pi_behave || pi_prox) per real token, estimated on the behaviour policy's own samples with the k3
    estimator (r - 1 - log r, r = pi_prox / pi_behave): unbiased, never negative. It measures how far the sampler
    drifted from the trainer: staleness plus the engine's numerics. A token the engine could not score (NaN) or
    padding counts 0 (selected, not multiplied by the mask: NaN * 0 is NaN)."""
    mask = mask.to(prox_logps.dtype)
    log_ratio = torch.where(mask.bool(), (prox_logps - behave_logps).detach(), torch.zeros_like(prox_logps))
    per_token = torch.exp(log_ratio) - 1.0 - log_ratio
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
