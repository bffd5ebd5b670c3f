"""``LogProbPasses``: how ``GRPOTrainer`` computes per-token log-probs (TRL's ``_get_per_token_logps_and_entropies``).

Every pass TRL asks for (the rollout's old-policy and reference passes, the loss pass) goes through the pass the run
chose (``passes``: padded, packed rows under a token budget, the shared prefix, the prefix tree), decided once at
the first pass and agreed by every rank where parameters are sharded. The loss pass's log-probs then go through the
trainer's seams (vLLM's correction from the loss pass, GSPO-token's shift: ``grpo.trainer``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..auto_switch import resolve_switch
from ..compat import trl_trainer_state as trl_state
from ..passes import LogProbPass, PackedPass, PaddedPass, PassRequest, PassResult, SharedPrefixPass
from ..passes.prefix_tree import PrefixTreePass, tree_is_cheaper
from ..passes.shared_prefix import all_ranks_can_share, unsupported_reason
from ..peft_models import is_peft_model
from ..trainer_part import TrainerPart


class LogProbPasses(TrainerPart):
    """``GRPOTrainer``'s component (``logprob_passes``): the pass each batch runs, the shared-prefix decision, and
    what a pass leaves in the profile and the logs."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        self.shared_prefix_decision: bool | None = None  # decided at the first pass
        self.shared_prefix_off_reason: str | None = None

    def choose(self, model, request: PassRequest, padded_forward: Callable) -> LogProbPass:
        """The pass for this batch: the run's choices (``padding_free``, ``shared_prefix``, each decided once at the
        first pass), except that a batch with a router loss or image inputs takes the padded pass (both cover the
        prompt tokens). With both on: the prefix-tree pass (each group's prompt once inside packed rows) where the
        attention takes a tree mask (sdpa, eager) and it costs fewer FLOPs on the batch (``tree_is_cheaper``), else
        the shared-prefix pass falling back to the packed one.

        Built per call, never kept on the trainer: a pass holds the trainer's bound methods (``padded_forward`` is TRL's
        pass), and a trainer -> pass ->
        trainer cycle would leave a finished trainer's engine to the cyclic garbage collector (see profiling's
        _StepClock)."""
        padded = PaddedPass(padded_forward)
        if request.has_extra_inputs:
            return padded
        rows = padded
        packing = self.trainer.pass_layout.padding_free_enabled(model)
        if packing:
            layout = dict(
                agree_max=self.trainer.pass_layout.agree_max,
                autocast=self.trainer.accelerator.autocast,
                max_tokens=self.trainer.args.max_tokens_per_microbatch,
                one_forward_with_grad=self.trainer.pass_layout.zero3_reentrant_checkpointing(model),
                coefficient=self.trainer.pass_layout.attention_cost_coefficient(),
                recompute=self.trainer.pass_layout.recompute_forwards(),
            )
            rows = PackedPass(padded, **layout)
        if not self.shared_prefix_enabled(model):
            return rows
        inner = self.trainer.accelerator.unwrap_model(model)
        if packing and PrefixTreePass.supports(inner):
            # The prefix tree (each group's prompt once, inside packed rows) where it costs fewer FLOPs than the
            # shared-prefix pass on this batch (tree_is_cheaper); every rank takes the same pass (collectives).
            cheaper = tree_is_cheaper(
                request.input_ids,
                request.attention_mask,
                request.logits_to_keep,
                inner.config,
                head_scores_every_position=self.trainer.accelerator.device.type != "cuda",
            )
            if self.trainer.pass_layout.agree_max(0 if cheaper else 1) == 0:
                return PrefixTreePass(rows, **layout)
        return SharedPrefixPass(
            rows,
            agree=self._all_ranks_can_share,
            autocast=self.trainer.accelerator.autocast,
            inner_model=self.trainer.accelerator.unwrap_model(model),
        )

    def record(self, result: PassResult, training: bool) -> None:
        """The profiler's count (from what the pass processed), the shared-prefix metric, and for the loss pass the
        layout's (``PassLayout.record_layout``: ``batch/pad_frac`` and the others)."""
        self.trainer.profiler.count_logprob_pass(result.row_lengths, training=training, token_ratio=result.token_ratio)
        mode = "train" if self.trainer.model.training else "eval"
        if result.chunk_token_ratios:
            trl_state.metrics(self.trainer, mode)["shared_prefix/token_ratio"].extend(result.chunk_token_ratios)
        if training:
            self.trainer.pass_layout.record_layout(result)

    def is_reference_pass(self, model) -> bool:
        """The reference model, or a LoRA policy with its adapters off / its 'ref' adapter on (TRL's reference)."""
        if model is getattr(self.trainer, "ref_model", None):
            return True
        unwrapped = self.trainer.accelerator.unwrap_model(model)
        if not is_peft_model(unwrapped):
            return False
        if unwrapped.active_adapter == "ref":
            return True
        lora_layer = next((m for m in unwrapped.modules() if hasattr(m, "lora_A")), None)
        return bool(getattr(lora_layer, "disable_adapters", False))

    def shared_prefix_enabled(self, model) -> bool:
        """Resolve `shared_prefix` once, at the first pass (gradient checkpointing is switched on by then)."""
        if self.shared_prefix_decision is None:
            setting = self.trainer.args.shared_prefix
            self.shared_prefix_decision, self.shared_prefix_off_reason = resolve_switch(
                "shared_prefix", setting, lambda: self.shared_prefix_blocker(model, auto=setting == "auto")
            )
        return self.shared_prefix_decision

    def shared_prefix_blocker(self, model, auto: bool) -> str | None:
        if getattr(self.trainer.args, "use_liger_kernel", False):
            return "use_liger_kernel computes the loss in a fused kernel from the full rows' hidden states"
        if self.trainer.is_fsdp_enabled and not self.trainer.accelerator.is_fsdp2:
            return (
                "FSDP1 is not verified with the shared pass (FSDP2 is): set fsdp_version: 2 in the Accelerate config"
            )
        if (
            self.trainer.is_deepspeed_enabled
            and self.trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
            and self.trainer.args.gradient_checkpointing
            and is_peft_model(self.trainer.accelerator.unwrap_model(model))
        ):
            # TRL (GRPOTrainer.__init__) forces use_reentrant=True for PEFT under ZeRO-3 with checkpointing, because
            # DeepSpeed's partitioned frozen weights break the non-reentrant kind's recompute check
            # (deepspeedai/DeepSpeed#4332); reentrant checkpointing cuts the gradient of the shared states.
            return (
                "TRL forces reentrant gradient checkpointing for a PEFT model under DeepSpeed ZeRO-3, and reentrant "
                "checkpointing cuts the gradient of the shared states; set gradient_checkpointing=False (or train "
                "all weights) to use it under ZeRO-3"
            )
        if auto and self.trainer.num_generations == 1:
            return "num_generations=1, so no prompt is repeated in a batch"
        if auto and self.trainer.args.max_tokens_per_microbatch:
            # The shared pass runs a chunk's rows whole (the prefix tree, where it is cheaper, is packed within the
            # bound): it would break the memory bound the field sets.
            return "max_tokens_per_microbatch bounds each forward's tokens, and the shared pass runs its rows whole"
        return unsupported_reason(self.trainer.accelerator.unwrap_model(model))

    def _all_ranks_can_share(self, local: bool) -> bool:
        """The per-chunk decision, agreed by all ranks whenever there are several (``all_ranks_can_share``)."""
        return all_ranks_can_share(
            local, self.trainer.accelerator.num_processes > 1, device=self.trainer.accelerator.device
        )
