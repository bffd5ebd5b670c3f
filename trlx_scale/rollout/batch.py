"""``RolloutBatch``: one rollout of a process, typed, from the engine's samples to the loss.

The rollout path of every trlx_scale RL trainer is

    engine (generate, tagged with the policy version it serves) -> RolloutBatch -> log-prob pass -> loss

TRL builds its rollout as a dict inside ``_generate_and_score_completions`` and splits, shuffles and slices that dict
into micro-batches (``split_tensor_dict``, ``shuffle_sequence_dict``), so the trainers keep TRL's dict on the wire and
the batch converts at the end: ``rollout.collector.RolloutCollector`` builds it (each algorithm then adds its own
quantities: ``GRPOTrainer._finish_rollout``, PPO's values and GAE), ``to_trl`` hands it to TRL's loss, every key in
TRL's order (TRL sizes its chunks by the first tensor). ``from_trl`` types a rollout TRL built itself (image inputs).
The rewards per function, the policy versions and the rows travel here, not in trainer attributes.

Shapes (B: this process's rows, B_all: every process's rows, P: prompt tokens, C: completion tokens, F: reward
functions), for ``layout == "padded"`` (the only layout on the wire: padding-free packed rows are laid out inside the
log-prob passes, ``passes.packed_rows``, from these padded tensors, and their outputs come back on this grid):

- ``prompt_ids``, ``prompt_mask``: (B, P), left-padded; ``completion_ids``, ``completion_mask``: (B, C), right-padded;
- ``advantages``: (B,) for GRPO-style losses (one per sequence), (B, C) for PPO (GAE, per token);
- ``rewards_per_func``: (B_all, F), every process's rows as TRL gathered them (a group can span processes);
  ``local_rewards_per_func`` is this process's (B, F) share;
- ``old_per_token_logps``: (B, C) the policy that generated the batch, by the trainer (None when the loss pass
  provides them: ``old_logprobs_from_loss_pass``); ``sampling_per_token_logps``: (B, C) the behaviour policy's, by
  the engine; ``ref_per_token_logps``: (B, C) the reference's (None without a KL term);
- ``old_values``, ``returns``: (B, C) PPO's critic values and GAE returns (None elsewhere);
- ``policy_version``: the version of the policy whose weights the engine served when it generated these samples
  (``TrainerFeatures.policy_version``): one int for the batch, or a (B,) tensor, one per row, where rows come from several
  versions (asynchronous generation); on the wire a (B,) int64 tensor, so it survives TRL's splits and shuffles;
- ``token_policy_version``: (B, C) int64, each completion token's policy version where a weight update can land inside
  a completion (asynchronous generation with full weights reloaded under requests kept in flight:
  ``full_weight_reload="keep"``); a row's ``policy_version`` is then its oldest token's. None elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# TRL's keys that have a typed field here; every other key of TRL's batch rides in ``extras`` unchanged.
_TYPED_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "advantages",
    "old_per_token_logps",
    "sampling_per_token_logps",
    "ref_per_token_logps",
    "old_values",
    "returns",
    "token_policy_version",
)
POLICY_VERSION_KEY = "policy_version"
LAYOUTS = ("padded",)


@dataclass
class RolloutBatch:
    """One process's rollout (see the module docstring for the shapes)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    rewards_per_func: torch.Tensor
    policy_version: int | torch.Tensor
    process_index: int = 0
    old_per_token_logps: torch.Tensor | None = None
    sampling_per_token_logps: torch.Tensor | None = None
    ref_per_token_logps: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    token_policy_version: torch.Tensor | None = None
    layout: str = "padded"
    extras: dict[str, Any] = field(default_factory=dict)
    # The process's dataset rows, with a rollout function's extra fields merged in (PPO reads each turn's reward
    # there); never on TRL's wire.
    rows: list[dict[str, Any]] | None = field(default=None, repr=False)
    _key_order: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"RolloutBatch.layout must be one of {LAYOUTS}, got {self.layout!r}.")
        rows = self.completion_ids.size(0)
        for name in ("prompt_ids", "prompt_mask", "completion_mask", "advantages"):
            if getattr(self, name).size(0) != rows:
                raise ValueError(f"RolloutBatch.{name} has {getattr(self, name).size(0)} rows, completion_ids {rows}.")

    @property
    def num_rows(self) -> int:
        return self.completion_ids.size(0)

    @property
    def local_rewards_per_func(self) -> torch.Tensor:
        """This process's rows of ``rewards_per_func`` (TRL gathers whole generation batches, process by process)."""
        start = self.process_index * self.num_rows
        return self.rewards_per_func[start : start + self.num_rows]

    @property
    def loss_mask(self) -> torch.Tensor:
        """The completion tokens that count: ``completion_mask``, times the tool mask of tool-calling rollouts."""
        tool_mask = self.extras.get("tool_mask")
        return self.completion_mask if tool_mask is None else self.completion_mask * tool_mask

    @classmethod
    def from_trl(
        cls,
        output: dict[str, Any],
        *,
        rewards_per_func: torch.Tensor,
        policy_version: int,
        process_index: int,
        rows: list[dict[str, Any]] | None = None,
    ) -> RolloutBatch:
        """TRL's rollout dict (``_generate_and_score_completions``' result), typed."""
        typed = {key: output[key] for key in _TYPED_KEYS if key in output}
        extras = {key: value for key, value in output.items() if key not in _TYPED_KEYS and key != POLICY_VERSION_KEY}
        return cls(
            **typed,
            rewards_per_func=rewards_per_func,
            policy_version=policy_version,
            process_index=process_index,
            extras=extras,
            rows=rows,
            _key_order=[key for key in output if key != POLICY_VERSION_KEY],
        )

    def to_trl(self) -> dict[str, Any]:
        """Back to TRL's dict, keys in TRL's order (then the ones added here), plus the per-row policy version."""
        values = {key: getattr(self, key) for key in _TYPED_KEYS}
        values.update(self.extras)
        added = [key for key in values if key not in self._key_order and values[key] is not None]
        trl = {key: values[key] for key in [*self._key_order, *added]}
        device = self.completion_ids.device
        if isinstance(self.policy_version, torch.Tensor):  # one per row (asynchronous generation)
            trl[POLICY_VERSION_KEY] = self.policy_version.to(device=device, dtype=torch.long)
        else:
            trl[POLICY_VERSION_KEY] = torch.full(
                (self.num_rows,), self.policy_version, dtype=torch.long, device=device
            )
        return trl


def batch_policy_versions(inputs: dict[str, Any]) -> torch.Tensor | None:
    """The per-row policy versions of a micro-batch on TRL's wire (None for a batch built elsewhere)."""
    return inputs.get(POLICY_VERSION_KEY)
