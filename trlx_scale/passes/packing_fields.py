"""``PackingFields``: the config fields of padding-free packed micro-batches, shared by GRPO, PPO and DPO."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..options import registers_options

PADDING_FREE_SETTINGS = ("auto", "true", "false")


# A plain TRL config means TRL's padded rows; a trlx_scale config packs where the model allows it.
@registers_options(plain_trl_defaults={"padding_free": "false"})
@dataclass
class PackingFields:
    """How the log-prob passes lay their rows out (``passes.packed``)."""

    padding_free: str = field(
        default="auto",
        metadata={
            "help": "Run every pass over the policy, the reference and the critic on padding-free packed rows "
            "(each sample's real tokens, position_ids restarting at 0, no attention mask) instead of rows padded to "
            "the longest completion; the loss is the padded one up to float rounding. 'auto' (default: on a "
            "long-tail workload the packed step is 2.3x TRL's padded one with less peak memory, and on "
            "the embedded model's GRPO step it is as fast: docs/benchmarks.md): on where the model keeps "
            "packed samples apart (sdpa/eager, flash-attention on GPU; checked once on the model), else off with "
            "the reason logged once; 'true': on, or an error naming what prevents it; 'false': padded rows, as TRL "
            "(and what a plain TRL config means).",
            "choices": list(PADDING_FREE_SETTINGS),
        },
    )
    max_tokens_per_microbatch: int | None = field(
        default=None,
        metadata={
            "help": "With padding_free: the most tokens of one packed row and of one forward, which bounds a "
            "forward's transient memory (its attention scores, the LM head's tiles). The loss pass still keeps every "
            "forward's activations until the micro-batch's one backward (TRL's loss spans the micro-batch), so the "
            "micro-batch's activations are bounded by per_device_train_batch_size, not by this. A sample longer than "
            "this gets a row of its own (counted in batch/oversize_samples, never dropped). Unset: packed rows take "
            "the width that costs least by the model's shape (at least the micro-batch's longest sample, at most "
            "twice it: a slightly wider row often holds the samples in one row fewer) and a forward holds at most "
            "what TRL's padded chunk held (per_device_train_batch_size rows of the padded width)."
        },
    )

    def validate_packing_fields(self) -> None:
        if isinstance(self.padding_free, bool):
            self.padding_free = "true" if self.padding_free else "false"
        if self.padding_free not in PADDING_FREE_SETTINGS:
            raise ValueError(
                f"padding_free must be one of {PADDING_FREE_SETTINGS}, got {self.padding_free!r}: 'auto' packs where "
                "the model supports it."
            )
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise ValueError(
                f"max_tokens_per_microbatch must be a positive number of tokens, got {self.max_tokens_per_microbatch}"
                " (unset it to pack by the micro-batch's longest sample)."
            )
