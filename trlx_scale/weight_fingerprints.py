"""Per-tensor fingerprints of weights: what a vLLM server says it loaded, compared with what the trainer wrote.

Why: checking a full-weight reload by parameter name (``compat.vllm_checked_reload``) catches a tensor left out, and
the log-prob probe catches weights that did not change; neither sees a tensor that arrived with other values (a file
damaged after it was written, a stale file at the path, a tensor of another layer under this one's name). So the
trainer writes each tensor's fingerprint beside the weights (``FINGERPRINTS_FILE``), the server's worker extension
fingerprints every tensor its reload reads, and the trainer compares the two (``mismatched``).

What a fingerprint is: the tensor's shape, and float64 sums over a fixed strided sample of its values (every value
of a tensor up to ``SAMPLED_VALUES`` elements, else that many evenly spaced ones): the sum, the sum of squares, a
position-weighted sum (a permutation changes it) and the sum of absolute values (the scale the tolerance is taken
against). A sample, not a hash of every byte, because the server computes it inside every reload: at 65536 values a
tensor its cost does not grow with the model, where SHA-256 of every byte runs at about 0.83 s per GiB on this
project's CPU machine (docs/benchmarks.md, checkpoint checksums): about two minutes per update for a 70B model in
bf16. What it does not catch: a change confined to values between the sampled ones of a tensor larger than the
sample.

The sums are compared within ``RELATIVE_TOLERANCE`` of the absolute sum: both sides add the same float64 values,
only in an order that may differ with their thread counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

FINGERPRINTS_FILE = "fingerprints.json"  # beside the weights: {tensor name: fingerprint}
SAMPLED_VALUES = 65536
POSITION_WEIGHT_PERIOD = 8191  # position weights 1..8191, repeating (a prime: no stride lines up with it)
RELATIVE_TOLERANCE = 1e-9


def fingerprint(tensor: torch.Tensor) -> dict[str, list[int] | list[float]]:
    """``{"shape": [...], "sums": [sum, sum of squares, position-weighted sum, sum of absolute values]}`` of
    ``tensor``'s sampled values (module docstring), as plain JSON values."""
    flat = tensor.detach().reshape(-1)
    count = flat.numel()
    if count > SAMPLED_VALUES:
        stride = math.ceil(count / SAMPLED_VALUES)
        flat = flat[::stride]
    values = flat.to(device="cpu", dtype=torch.float64)
    weights = torch.arange(values.numel(), dtype=torch.float64) % POSITION_WEIGHT_PERIOD + 1
    sums = [values.sum(), values.square().sum(), (values * weights).sum(), values.abs().sum()]
    return {"shape": list(tensor.shape), "sums": [float(value) for value in sums]}


def mismatched(sent: Mapping[str, dict], loaded: Mapping[str, dict]) -> list[str]:
    """Names of the tensors whose loaded fingerprint differs from the one sent (or that were sent and not read), with
    what differs."""
    problems = []
    for name, expected in sent.items():
        seen = loaded.get(name)
        if seen is None:
            problems.append(f"{name} (not read)")
            continue
        if list(seen["shape"]) != list(expected["shape"]):
            problems.append(f"{name} (shape {list(seen['shape'])}, sent {list(expected['shape'])})")
            continue
        scale = expected["sums"][3]
        squares_scale = expected["sums"][1]
        tolerances = [
            RELATIVE_TOLERANCE * scale,
            RELATIVE_TOLERANCE * squares_scale,
            RELATIVE_TOLERANCE * scale * POSITION_WEIGHT_PERIOD,
            RELATIVE_TOLERANCE * scale,
        ]
        for got, want, tolerance in zip(seen["sums"], expected["sums"], tolerances, strict=True):
            if not abs(got - want) <= tolerance + 1e-300:  # also catches NaN
                problems.append(f"{name} (values differ)")
                break
    return problems
