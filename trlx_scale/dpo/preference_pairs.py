"""Preference data from the colocated engine: reference log-prob sums of collated pairs, and online (best, worst) pairs."""

from __future__ import annotations

from typing import Protocol

import torch


class SequenceScorer(Protocol):
    def sequence_logprobs(self, sequences: list[list[int]], use_adapter: bool = False) -> list[list[float]]: ...


def completion_logprob_sums(
    scorer: SequenceScorer, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor
) -> list[float]:
    """Sum of each row's completion-token log-probs, for rows collated by TRL's ``DataCollatorForPreference``.

    Rows are right-padded; token ``t`` counts when ``completion_mask[t]`` is set, with the log-prob the model gives it
    after tokens ``< t`` (what TRL's reference pass sums).
    """
    lengths = attention_mask.sum(dim=1).tolist()
    sequences = [row[:length].tolist() for row, length in zip(input_ids, lengths, strict=True)]
    logprobs = scorer.sequence_logprobs(sequences, use_adapter=False)
    sums = []
    for values, mask, length in zip(logprobs, completion_mask, lengths, strict=True):
        scored = mask[1:length].tolist()  # values[t - 1] belongs to token t
        sums.append(float(sum(v for v, keep in zip(values, scored, strict=True) if keep)))
    return sums


def best_worst_pairs(
    prompt_ids: list[list[int]], completion_ids: list[list[int]], rewards: torch.Tensor
) -> tuple[list[dict[str, list[int]]], dict[str, float]]:
    """One (chosen = highest reward, rejected = lowest) pair per prompt whose samples' rewards differ.

    ``rewards`` is ``(num_prompts, group)``, rows in the order of ``completion_ids`` (a prompt's samples together).
    NaN rewards (a reward function abstained) rank as neither best nor worst. Returns the pairs and round statistics.
    """
    num_prompts, group = rewards.shape
    pairs = []
    gaps = []
    for i in range(num_prompts):
        row = rewards[i]
        valid = ~torch.isnan(row)
        if valid.sum() < 2:
            continue
        best = int(torch.where(valid, row, -torch.inf).argmax())
        worst = int(torch.where(valid, row, torch.inf).argmin())
        if row[best] <= row[worst]:
            continue
        pairs.append(
            {
                "prompt_ids": list(prompt_ids[i]),
                "chosen_ids": list(completion_ids[i * group + best]),
                "rejected_ids": list(completion_ids[i * group + worst]),
            }
        )
        gaps.append(float(row[best] - row[worst]))
    stats = {
        "reward_mean": float(torch.nanmean(rewards)) if rewards.numel() else 0.0,
        "pair_fraction": len(pairs) / max(num_prompts, 1),
        "reward_gap": sum(gaps) / len(gaps) if gaps else 0.0,
    }
    return pairs, stats
