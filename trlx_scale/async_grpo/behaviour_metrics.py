"""``async/sampler_trainer_kl`` and ``async/behaviour_weight_clip_frac``: how far the servers' samples are from the
trainer's policy, and how much of the off-policy correction its bounds changed (docs/async.md, "The metrics")."""

from __future__ import annotations

import torch

from ..compat import trl_trainer_state as trl_state
from ..losses.vllm_importance_sampling import (
    behaviour_kl,
    is_sequence_level,
    unbounded_log_weights,
    vllm_importance_sampling_ratio,
)
from ..trainer_part import TrainerPart


class BehaviourMetrics(TrainerPart):
    """Part of ``AsyncGRPOTrainer``: logs the behaviour policy's distance from the trainer's at every rollout, and
    takes a sequence mode's weight as ``sequence_behaviour_weight`` says."""

    def sequence_weight_normalisation(self) -> str:
        # Read by the rollout collector's correction and by the loss pass's (deferred) one alike.
        return "mean" if self.trainer.args.sequence_behaviour_weight == "geometric_mean" else "sum"

    def deferred_correction(self, base_correction, logps: torch.Tensor, inputs: dict) -> None:
        """The loss pass's correction (``base_correction``: GRPOTrainer's), and the behaviour metrics of a batch it
        corrected."""
        had = "importance_sampling_ratio" in inputs
        base_correction(logps, inputs)
        if not had and "importance_sampling_ratio" in inputs:
            mask = inputs["completion_mask"]
            if "tool_mask" in inputs:  # tool results were not sampled: no behaviour log-prob to compare
                mask = mask * inputs["tool_mask"]
            self.log(logps.detach(), inputs["sampling_per_token_logps"], mask)

    def log(self, prox: torch.Tensor, behave: torch.Tensor, mask: torch.Tensor) -> None:
        """``async/sampler_trainer_kl`` (k3 estimate of KL(pi_behave || pi_prox) per token) and
        ``async/behaviour_weight_clip_frac``: the share of tokens (sequences, in a sequence mode) whose weight
        pi_prox / pi_behave the correction's bounds changed (truncated or masked)."""
        mask = mask.to(prox.dtype)
        behave = torch.nan_to_num(behave, nan=0.0)
        mode = self.trainer.vllm_importance_sampling_mode
        bounded = vllm_importance_sampling_ratio(
            prox,
            behave,
            mask,
            mode,
            self.trainer.vllm_importance_sampling_clip_min,
            self.trainer.vllm_importance_sampling_clip_max,
            self.sequence_weight_normalisation(),
        )
        sequence = is_sequence_level(mode)
        raw = torch.exp(unbounded_log_weights(prox, behave, mask, mode, self.sequence_weight_normalisation()))
        changed = (raw != bounded).to(mask.dtype)
        if sequence:
            counted = (mask.sum(-1, keepdim=True) > 0).to(mask.dtype)
            fraction = (changed * counted).sum() / counted.sum().clamp(min=1.0)
        else:
            fraction = (changed * mask).sum() / mask.sum().clamp(min=1.0)
        stats = torch.stack([behaviour_kl(prox, behave, mask), fraction])
        stats = self.trainer.accelerator.gather(stats.unsqueeze(0)).mean(0)
        metrics = trl_state.metrics(self.trainer, "train" if self.trainer.model.training else "eval")
        metrics["async/sampler_trainer_kl"].append(stats[0].item())
        metrics["async/behaviour_weight_clip_frac"].append(stats[1].item())
