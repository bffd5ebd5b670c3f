"""``PassLayout``: whether a trainer's passes run on packed rows (``padding_free``), and what they log.

Shared by GRPO/PPO (``PackedPass`` for every log-prob pass, the critic's packed values) and DPO (the chosen and
rejected forwards through ``PackedModelCall``). The decision is taken once, at a run's first pass, where every rank
is (the isolation check runs forwards, and under sharded parameters every rank must run them).
"""

from __future__ import annotations

from typing import Any

import torch

from ..auto_switch import resolve_switch
from ..compat import trl_trainer_state as trl_state
from ..compat.checkpoint_with_cache import uses_reentrant_checkpointing
from ..trainer_part import TrainerPart
from .logprob_pass import PassResult
from .micro_batch_plan import attention_cost_coefficient as cost_coefficient
from .packing_support import check_packing_isolated, packing_unsupported_reason


class PassLayout(TrainerPart):
    """The trainer's decision on packed rows and recomputed forwards, and the layout metrics of its loss passes,
    for a ``transformers.Trainer`` with TRL's fused LM head on its model (the trainer holds it as ``pass_layout``)."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        self.padding_free_decision: bool | None = None  # decided at the first pass
        self.padding_free_off_reason: str | None = None
        self.recompute_forwards_decision: bool | None = None

    def attention_cost_coefficient(self) -> float:
        config = self.trainer.accelerator.unwrap_model(self.trainer.model).config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cost_coefficient(int(config.hidden_size), getattr(config, "intermediate_size", None))

    def padding_free_enabled(self, model) -> bool:
        """Resolve ``padding_free`` once, at the first pass: the static gate, then the model's own check (its
        forwards run on every rank together: the first pass is a collective point)."""
        if self.padding_free_decision is None:
            self.padding_free_decision, self.padding_free_off_reason = resolve_switch(
                "padding_free", self.trainer.args.padding_free, lambda: self._padding_free_blocker(model)
            )
            if not self.padding_free_decision and self.trainer.args.recompute_forwards == "true":
                raise ValueError(
                    "recompute_forwards='true' recomputes packed forwards, and the passes are not packed "
                    f"({self.padding_free_off_reason}): set recompute_forwards='auto' or 'false', or let "
                    "padding_free apply."
                )
        return self.padding_free_decision

    def recompute_forwards(self) -> bool:
        """``recompute_forwards`` for the packed passes (``passes.forward_recompute``), decided once: 'auto' is on
        where ``max_tokens_per_microbatch`` is set (without it a loss pass is one forward: nothing to free) and the
        layout allows it (``_recompute_forwards_blocker``)."""
        if self.recompute_forwards_decision is None:
            setting = self.trainer.args.recompute_forwards
            if setting == "auto" and self.trainer.args.max_tokens_per_microbatch is None:
                self.recompute_forwards_decision = False
            else:
                self.recompute_forwards_decision, _ = resolve_switch(
                    "recompute_forwards", setting, self._recompute_forwards_blocker
                )
        return self.recompute_forwards_decision

    def _recompute_forwards_blocker(self) -> str | None:
        if self.trainer.is_deepspeed_enabled and self.trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
            # trl.trainer.utils.maybe_gather_lm_head_ctx reads `ds_status` on the weight the head saved; a
            # recomputed forward's saved tensors are plain tensors without DeepSpeed's attributes (AttributeError).
            return (
                "under DeepSpeed ZeRO-3, TRL's fused LM head gathers its weight in the backward through DeepSpeed's "
                "attributes on the saved weight, which a recomputed forward's saved tensors do not carry"
            )
        return None

    def _padding_free_blocker(self, model) -> str | None:
        if getattr(self.trainer.args, "use_liger_kernel", False):
            return "use_liger_kernel computes the loss in a fused kernel from padded rows' hidden states"
        if self.trainer.is_fsdp_enabled and not self.trainer.accelerator.is_fsdp2:
            return "FSDP1 is not verified with packed rows (FSDP2 is): set fsdp_version: 2 in the Accelerate config"
        inner = self.trainer.accelerator.unwrap_model(model)
        reason = packing_unsupported_reason(inner, self.trainer.accelerator.device.type)
        local = reason is None
        if self.agree_max(0 if local else 1):  # every rank decides alike (the check below runs forwards)
            return reason or "another rank's model cannot run packed rows"
        config = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
        reason = check_packing_isolated(
            model, int(config.vocab_size), self.trainer.accelerator.device, self.trainer.accelerator.autocast
        )
        if self.agree_max(0 if reason is None else 1):
            return reason or "packed samples were not kept apart on another rank"
        return None

    def zero3_reentrant_checkpointing(self, model) -> bool:
        """ZeRO-3 with reentrant gradient checkpointing: a pass with gradients must be one forward (passes.packed)."""
        if not self.trainer.is_deepspeed_enabled or self.trainer.accelerator.state.deepspeed_plugin.zero_stage != 3:
            return False
        return uses_reentrant_checkpointing(self.trainer.accelerator.unwrap_model(model))

    def record_layout(self, result: PassResult) -> None:
        """The layout metrics of a loss pass (every rank runs it: one gather): ``batch/pad_frac`` (processed
        positions no sample owns), ``batch/packing_ratio`` (positions processed per real token of the rows: above 1
        padding, below 1 a shared prefix), ``batch/rank_imbalance`` (max over mean of the ranks' cost),
        ``batch/tokens_per_microbatch``, ``batch/forwards_per_microbatch``, ``batch/oversize_samples``,
        ``batch/recomputed_forwards`` (forwards the backward recomputes: ``recompute_forwards``)."""
        if result.processed_tokens <= 0:
            return
        mode = "train" if self.trainer.model.training else "eval"
        cost = result.processed_tokens * (self.attention_cost_coefficient() + result.row_tokens)
        real = float(result.row_lengths.sum())  # the rows' real tokens: what any pass must cover
        # One gather per loss pass (every rank runs it): processed, padding and real tokens, cost, forwards, oversize.
        values = [
            result.processed_tokens,
            result.padding_tokens,
            real,
            cost,
            result.forwards,
            result.oversize_samples,
            result.recomputed_forwards,
        ]
        local = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.trainer.accelerator.device)
        ranks = self.trainer.accelerator.gather(local.unsqueeze(0)).reshape(-1, local.numel())
        processed, padding, real, costs, forwards, oversize, recomputed = ranks.unbind(dim=1)
        metrics = trl_state.metrics(self.trainer, mode)
        metrics["batch/pad_frac"].append(padding.sum().item() / processed.sum().item())
        metrics["batch/packing_ratio"].append(processed.sum().item() / max(real.sum().item(), 1.0))
        metrics["batch/rank_imbalance"].append((costs.max() / costs.mean().clamp(min=1e-12)).item())
        metrics["batch/tokens_per_microbatch"].append(processed.mean().item())
        metrics["batch/forwards_per_microbatch"].append(forwards.max().item())
        metrics["batch/oversize_samples"].append(oversize.sum().item())
        metrics["batch/recomputed_forwards"].append(recomputed.max().item())

    def agree_max(self, value: int) -> int:
        """The largest of every rank's ``value`` under several processes, where every rank must run the same
        forwards: sharded parameters (ZeRO-3, FSDP2) gather in each forward, and DDP broadcasts its buffers in each
        forward and reduces gradients after it (a rank running another pass than its peer hangs both)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=self.trainer.accelerator.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())
