"""``LossPassCorrectionMixin``: what ``GRPOTrainer`` does with the loss pass's log-probs before TRL's loss uses them.

TRL computes the loss pass's log-probs inside ``_compute_loss`` and forms the ratios inline. Two things happen in
between, at seams a subclass can override:

- vLLM's importance-sampling correction from the loss pass (``old_logprobs_from_loss_pass``): where the loss pass
  runs with the weights that generated the batch, the rollout collector runs no separate old-policy pass and the
  correction is computed from the loss pass's detached log-probs (``_defers_old_logprobs``, ``_deferred_correction``);
- GSPO-token's weights through TRL's token branch (``_postprocess_loss_logps``).

Both need the micro-batch, which TRL's ``_compute_loss`` does not hand to the pass it runs
(``_get_per_token_logps_and_entropies`` takes token ids and masks only). The batch is bound for the duration of that
one call in a context variable (``loss_pass_batch``): not a trainer attribute, so nothing of a micro-batch outlives its
call or is seen by another thread, and no TRL call order is assumed.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch

from ..compat import trl_trainer_state as trl_state
from ..losses.policy_losses import log_importance_weights
from ..losses.vllm_importance_sampling import vllm_importance_sampling_ratio
from ..options import option
from ..rollout.collector import log_importance_sampling

_LOSS_PASS_BATCH: ContextVar[dict | None] = ContextVar("trlx_scale_loss_pass_batch", default=None)


def loss_pass_batch() -> dict | None:
    """The micro-batch of the ``_compute_loss`` call in progress (None outside one: a rollout's passes)."""
    return _LOSS_PASS_BATCH.get()


class LossPassCorrectionMixin:
    """Part of ``GRPOTrainer`` (see the module docstring); placed before TRL's class in its bases."""

    def _compute_loss(self, model, inputs):
        # TRL computes the loss pass's log-probs inside _compute_loss and forms the ratios inline; the batch is bound
        # for this call so that the pass's seams (_deferred_correction, _postprocess_loss_logps) see it.
        token = _LOSS_PASS_BATCH.set(inputs)
        try:
            return super()._compute_loss(model, inputs)
        finally:
            _LOSS_PASS_BATCH.reset(token)

    def _postprocess_loss_logps(self, logps: torch.Tensor, inputs: dict) -> torch.Tensor:
        """Seam: the loss pass's per-token log-probs, before TRL turns them into importance ratios.

        GSPO-token: TRL's token branch computes `per_token_logps - old_per_token_logps` (pinned by a contract test);
        returning `old + w` makes that difference GSPO-token's log weight `w` (losses.log_importance_weights). The
        config allows this level only with loss_type="grpo", beta=0 and no off-policy mask, where the log-probs feed
        nothing but that difference.
        """
        if not self.uses_sequence_token_ratios:
            return logps
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        return old + log_importance_weights(logps, old, mask, "sequence_token")

    def _defers_old_logprobs(self) -> bool:
        """Seam: whether vLLM's importance-sampling correction comes from the loss pass instead of a separate
        old-policy pass in the rollout (``old_logprobs_from_loss_pass``). Valid when the loss pass runs with the weights that
        generated the batch: TRL's own alignment condition (it then takes the loss pass's detached log-probs as the
        old ones itself, without vLLM). PPO needs its old log-probs in the rollout (KL rewards) and overrides this."""
        if not (self.use_vllm and self.vllm_importance_sampling_correction):
            return False
        if not option(self.args, "old_logprobs_from_loss_pass"):
            return False
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every == 0

    def _deferred_correction(self, logps: torch.Tensor, inputs: dict) -> None:
        """vLLM's importance-sampling correction of a batch whose old-policy pass was skipped, from the loss pass's
        log-probs (detached: they are the old ones), put where TRL's loss reads it; and TRL's sampling/* metrics.
        A no-op for a batch that already has its correction (TRL's pass ran)."""
        if "importance_sampling_ratio" in inputs or "sampling_per_token_logps" not in inputs:
            return
        if not self._defers_old_logprobs():
            return
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        old, sampling = logps.detach(), inputs["sampling_per_token_logps"]
        mode = self.vllm_importance_sampling_mode
        ratio = vllm_importance_sampling_ratio(
            old,
            sampling,
            mask,
            mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
            self._sequence_weight_normalisation(),
        )
        inputs["importance_sampling_ratio"] = ratio
        metrics = trl_state.metrics(self, "train" if self.model.training else "eval")
        log_importance_sampling(self, metrics, old, sampling, ratio, mask)

    def _sequence_weight_normalisation(self) -> str:
        """Seam: how a sequence mode's correction weight combines its tokens (TRL's product here; the asynchronous
        trainer's ``sequence_behaviour_weight``)."""
        return "sum"
