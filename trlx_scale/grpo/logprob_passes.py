"""``LogProbPassesMixin``: how ``GRPOTrainer`` computes per-token log-probs (TRL's ``_get_per_token_logps_and_entropies``).

Every pass TRL asks for (the rollout's old-policy and reference passes, the loss pass) goes through the pass the run
chose (``passes``: padded, packed rows under a token budget, the shared prefix, the prefix tree), decided once at
the first pass and agreed by every rank where parameters are sharded. The loss pass's log-probs then go through the
seams of ``LossPassCorrectionMixin`` (vLLM's correction from the loss pass, GSPO-token's shift).
"""

from __future__ import annotations

import contextlib

import torch

from ..auto_switch import resolve_switch
from ..compat import trl_trainer_state as trl_state
from ..options import option
from ..passes import LogProbPass, PackedPass, PaddedPass, PassRequest, PassResult, SharedPrefixPass
from ..passes.prefix_tree import PrefixTreePass, tree_is_cheaper
from ..passes.shared_prefix import all_ranks_can_share, unsupported_reason
from ..peft_models import is_peft_model
from .loss_pass_correction import loss_pass_batch


class LogProbPassesMixin:
    """Part of ``GRPOTrainer`` (see the module docstring); placed before TRL's class in its bases."""

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        pixel_values=None,
        image_grid_thw=None,
        num_images=None,
        pixel_attention_mask=None,
        spatial_shapes=None,
        num_tiles=None,
        image_sizes=None,
        token_type_ids=None,
        mm_token_type_ids=None,
        image_position_ids=None,
    ):
        request = PassRequest(
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size,
            compute_entropy,
            compute_aux_loss,
            extra_inputs=dict(
                pixel_values=pixel_values,
                image_grid_thw=image_grid_thw,
                num_images=num_images,
                pixel_attention_mask=pixel_attention_mask,
                spatial_shapes=spatial_shapes,
                num_tiles=num_tiles,
                image_sizes=image_sizes,
                token_type_ids=token_type_ids,
                mm_token_type_ids=mm_token_type_ids,
                image_position_ids=image_position_ids,
            ),
        )
        training = torch.is_grad_enabled()
        # A no-grad pass is a rollout's old-policy or reference pass (the loss pass's time is its own phase).
        name = "ref_logprobs" if not training and self._is_reference_pass(model) else "old_logprobs"
        with self.phase_timer.phase(name) if not training else contextlib.nullcontext():
            result = self._choose_logprob_pass(model, request).run(model, request)
        self._record_pass(result, training)
        logps = result.logps
        batch = loss_pass_batch()  # the loss pass's micro-batch, inside TRL's _compute_loss
        if batch is not None:
            self._deferred_correction(logps, batch)  # from the raw log-probs, before any seam
            logps = self._postprocess_loss_logps(logps, batch)
        return logps, result.entropies, result.aux_loss

    def _choose_logprob_pass(self, model, request: PassRequest) -> LogProbPass:
        """The pass for this batch: the run's choices (``padding_free``, ``shared_prefix``, each decided once at the
        first pass), except that a batch with a router loss or image inputs takes the padded pass (both cover the
        prompt tokens). With both on: the prefix-tree pass (each group's prompt once inside packed rows) where the
        attention takes a tree mask (sdpa, eager) and it costs fewer FLOPs on the batch (``tree_is_cheaper``), else
        the shared-prefix pass falling back to the packed one.

        Built per call, never kept on the trainer: a pass holds the trainer's bound methods, and a trainer -> pass ->
        trainer cycle would leave a finished trainer's engine to the cyclic garbage collector (see profiling's
        _StepClock)."""
        padded = PaddedPass(super()._get_per_token_logps_and_entropies)
        if request.has_extra_inputs:
            return padded
        rows = padded
        packing = self._padding_free_enabled(model)
        if packing:
            layout = dict(
                agree_max=self._agree_max,
                autocast=self.accelerator.autocast,
                max_tokens=option(self.args, "max_tokens_per_microbatch"),
                one_forward_with_grad=self._zero3_reentrant_checkpointing(model),
                coefficient=self._attention_cost_coefficient(),
                recompute=self._recompute_forwards(),
            )
            rows = PackedPass(padded, **layout)
        if not self._shared_prefix_enabled(model):
            return rows
        inner = self.accelerator.unwrap_model(model)
        if packing and PrefixTreePass.supports(inner):
            # The prefix tree (each group's prompt once, inside packed rows) where it costs fewer FLOPs than the
            # shared-prefix pass on this batch (tree_is_cheaper); every rank takes the same pass (collectives).
            cheaper = tree_is_cheaper(
                request.input_ids,
                request.attention_mask,
                request.logits_to_keep,
                inner.config,
                head_scores_every_position=self.accelerator.device.type != "cuda",
            )
            if self._agree_max(0 if cheaper else 1) == 0:
                return PrefixTreePass(rows, **layout)
        return SharedPrefixPass(
            rows,
            agree=self._all_ranks_can_share,
            autocast=self.accelerator.autocast,
            inner_model=self.accelerator.unwrap_model(model),
        )

    def _record_pass(self, result: PassResult, training: bool) -> None:
        """The profiler's count (from what the pass processed), the shared-prefix metric, and for the loss pass the
        layout's (``PaddingFreeMixin._record_layout``: ``batch/pad_frac`` and the others)."""
        self._count_logprob_pass(result.row_lengths, training=training, token_ratio=result.token_ratio)
        mode = "train" if self.model.training else "eval"
        if result.chunk_token_ratios:
            trl_state.metrics(self, mode)["shared_prefix/token_ratio"].extend(result.chunk_token_ratios)
        if training:
            self._record_layout(result)

    def _is_reference_pass(self, model) -> bool:
        """The reference model, or a LoRA policy with its adapters off / its 'ref' adapter on (TRL's reference)."""
        if model is getattr(self, "ref_model", None):
            return True
        unwrapped = self.accelerator.unwrap_model(model)
        if not is_peft_model(unwrapped):
            return False
        if unwrapped.active_adapter == "ref":
            return True
        lora_layer = next((m for m in unwrapped.modules() if hasattr(m, "lora_A")), None)
        return bool(getattr(lora_layer, "disable_adapters", False))

    def _shared_prefix_enabled(self, model) -> bool:
        """Resolve `shared_prefix` once, at the first pass (gradient checkpointing is switched on by then)."""
        if getattr(self, "_shared_prefix_decision", None) is None:
            setting = option(self.args, "shared_prefix")
            self._shared_prefix_decision, self.shared_prefix_off_reason = resolve_switch(
                "shared_prefix", setting, lambda: self._shared_prefix_blocker(model, auto=setting == "auto")
            )
        return self._shared_prefix_decision

    def _shared_prefix_blocker(self, model, auto: bool) -> str | None:
        if getattr(self.args, "use_liger_kernel", False):
            return "use_liger_kernel computes the loss in a fused kernel from the full rows' hidden states"
        if self.is_fsdp_enabled and not self.accelerator.is_fsdp2:
            return (
                "FSDP1 is not verified with the shared pass (FSDP2 is): set fsdp_version: 2 in the Accelerate config"
            )
        if (
            self.is_deepspeed_enabled
            and self.accelerator.state.deepspeed_plugin.zero_stage == 3
            and self.args.gradient_checkpointing
            and is_peft_model(self.accelerator.unwrap_model(model))
        ):
            # TRL (GRPOTrainer.__init__) forces use_reentrant=True for PEFT under ZeRO-3 with checkpointing, because
            # DeepSpeed's partitioned frozen weights break the non-reentrant kind's recompute check
            # (deepspeedai/DeepSpeed#4332); reentrant checkpointing cuts the gradient of the shared states.
            return (
                "TRL forces reentrant gradient checkpointing for a PEFT model under DeepSpeed ZeRO-3, and reentrant "
                "checkpointing cuts the gradient of the shared states; set gradient_checkpointing=False (or train "
                "all weights) to use it under ZeRO-3"
            )
        if auto and self.num_generations == 1:
            return "num_generations=1, so no prompt is repeated in a batch"
        if auto and option(self.args, "max_tokens_per_microbatch"):
            # The shared pass runs a chunk's rows whole (the prefix tree, where it is cheaper, is packed within the
            # bound): it would break the memory bound the field sets.
            return "max_tokens_per_microbatch bounds each forward's tokens, and the shared pass runs its rows whole"
        return unsupported_reason(self.accelerator.unwrap_model(model))

    def _all_ranks_can_share(self, local: bool) -> bool:
        """The per-chunk decision, agreed by all ranks whenever there are several (``all_ranks_can_share``)."""
        return all_ranks_can_share(local, self.accelerator.num_processes > 1, device=self.accelerator.device)
