"""weight_fingerprints: what a server's reload read against what the trainer wrote, tensor by tensor."""

from __future__ import annotations

import torch

from trlx_scale.weight_fingerprints import SAMPLED_VALUES, fingerprint, mismatched


def _prints(tensors):
    return {name: fingerprint(tensor) for name, tensor in tensors.items()}


def test_the_same_values_match_whatever_their_memory_layout():
    weight = torch.randn(64, 48)
    half = torch.randn(8, 8).to(torch.bfloat16)  # a bf16 server's file: the same bf16 values on both sides
    sent = _prints({"w": weight, "h": half})
    loaded = _prints({"w": weight.t().contiguous().t(), "h": half.clone()})  # a strided view, a copy
    assert mismatched(sent, loaded) == []


def test_a_changed_value_a_permutation_a_shape_and_a_missing_tensor_are_named():
    weight, bias = torch.randn(32, 16), torch.randn(16)
    sent = _prints({"w": weight, "b": bias, "h": torch.randn(4, 4)})
    changed = weight.clone()
    changed[3, 5] += 1e-3
    loaded = _prints({"w": changed, "b": bias.flip(0), "h": torch.randn(2, 8)})
    assert mismatched(sent, loaded) == [
        "w (values differ)",
        "b (values differ)",  # the same values in another order: the position-weighted sum differs
        "h (shape [2, 8], sent [4, 4])",
    ]
    del loaded["h"]
    assert mismatched(sent, loaded)[-1] == "h (not read)"


def test_a_large_tensor_is_sampled_and_a_change_at_a_sampled_position_is_caught():
    big = torch.randn(SAMPLED_VALUES * 3 + 7)
    sent = _prints({"e": big})
    damaged = big.clone()
    damaged[3 * 1000] = 0.0  # position 3000: a multiple of the stride (4), so sampled
    assert mismatched(sent, _prints({"e": damaged})) == ["e (values differ)"]
    zeroed_tail = big.clone()
    zeroed_tail[-SAMPLED_VALUES:] = 0.0  # a truncated write's zeros
    assert mismatched(sent, _prints({"e": zeroed_tail})) == ["e (values differ)"]
    assert mismatched(sent, _prints({"e": big.clone()})) == []


def test_nan_never_matches():
    sent = _prints({"w": torch.ones(3)})
    assert mismatched(sent, _prints({"w": torch.tensor([1.0, float("nan"), 1.0])})) == ["w (values differ)"]
