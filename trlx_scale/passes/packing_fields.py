"""``PackingFields``: the config fields of padding-free packed micro-batches, shared by GRPO, PPO and DPO."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..auto_switch import SWITCH_SETTINGS, switch_setting, switch_value
from ..trl_config_upgrade import registers_options


# A plain TRL config means TRL's padded rows; a trlx_scale config packs where the model allows it.
@registers_options(plain_trl_defaults={"padding_free": False})
@dataclass
class PackingFields:
    """How the log-prob passes lay their rows out (``passes.packed``)."""

    # TRL's type (DPOConfig.padding_free is a bool), with None for the measured default: decided on the model.
    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Run every pass over the policy, the reference and the critic on padding-free packed rows "
            "(each sample's real tokens, position_ids restarting at 0, no attention mask) instead of rows padded to "
            "the longest completion; the loss is the padded one up to float rounding. Unset (None, default: on a "
            "long-tail workload the packed step is 2.3x TRL's padded one with less peak memory, and on "
            "the embedded model's GRPO step it is as fast: docs/benchmarks.md): on where the model keeps "
            "packed samples apart (sdpa/eager, flash-attention on GPU; checked once on the model), else off with "
            "the reason logged once; True: on, or an error naming what prevents it; False: padded rows, as TRL "
            "(and what a plain TRL config means). A bool as in TRL's DPOConfig; 'auto', 'true' and 'false' are read "
            "as None, True and False."
        },
    )
    max_tokens_per_microbatch: int | None = field(
        default=None,
        metadata={
            "help": "With padding_free: the most tokens of one packed row and of one forward. With "
            "recompute_forwards (on by default once this is set, except under ZeRO-3) it bounds the loss pass's "
            "memory too: a micro-batch keeps one forward's activations, not all of them (verl's "
            "ppo_max_token_len_per_gpu; the shared-prefix pass's KV-cache chunks are not cut by it). A "
            "sample longer than this gets a row of its own (counted in batch/oversize_samples, never dropped). "
            "Unset: packed rows take the width that costs least by the model's shape (at least the micro-batch's "
            "longest sample, at most twice it: a slightly wider row often holds the samples in one row fewer) and a "
            "forward holds at most what TRL's padded chunk held (per_device_train_batch_size rows of the padded "
            "width)."
        },
    )
    recompute_forwards: str = field(
        default="auto",
        metadata={
            "help": "With padding_free: when a loss pass runs several packed forwards, keep none of their "
            "activations for the backward; the backward re-runs each forward (non-reentrant activation "
            "checkpointing around the whole forward), one at a time. TRL's loss spans the micro-batch, so without "
            "this every forward's activations and LM-head tensors live until the micro-batch's backward. The "
            "gradient is the same; the cost is one more forward per micro-batch. 'auto' (default): on where "
            "max_tokens_per_microbatch is set, since that budget then is a memory bound as in verl (measured on a "
            "long-tail micro-batch in 5 forwards: peak 471 -> 233 MiB, the step about 25 percent longer; "
            "docs/benchmarks.md, 'Recomputed forwards'), off without it (a loss pass is then one forward: nothing "
            "to free) and under DeepSpeed ZeRO-3 (TRL's fused LM head cannot gather its weight from a recomputed "
            "forward); 'true': on, or an error naming what prevents it (no budget, the passes not packed, "
            "ZeRO-3); 'false': every forward's graph is kept until the backward (the faster step, where memory "
            "allows).",
            "choices": list(SWITCH_SETTINGS),
        },
    )

    def validate_packing_fields(self) -> None:
        self.padding_free = switch_value("padding_free", self.padding_free)
        self.recompute_forwards = switch_setting(
            "recompute_forwards",
            self.recompute_forwards,
            "'auto' recomputes the packed forwards where max_tokens_per_microbatch is set",
        )
        if self.recompute_forwards == "true" and self.padding_free is False:
            raise ValueError(
                "recompute_forwards='true' recomputes packed forwards, and padding_free=False packs none: leave "
                "padding_free unset (packed where the model allows it) or set recompute_forwards='auto'."
            )
        if self.recompute_forwards == "true" and self.max_tokens_per_microbatch is None:
            raise ValueError(
                "recompute_forwards='true' needs max_tokens_per_microbatch: without a token budget a loss pass is one "
                "forward, with nothing to recompute. Set max_tokens_per_microbatch, or recompute_forwards='auto'."
            )
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise ValueError(
                f"max_tokens_per_microbatch must be a positive number of tokens, got {self.max_tokens_per_microbatch}"
                " (unset it to pack by the micro-batch's longest sample)."
            )
