"""Policy losses against values computed by hand in float64 (see each docstring)."""

import math

import pytest
import torch

from trlx_scale.losses import log_importance_weights

from .helpers.policy_loss_reference import clipped_policy_loss

F64 = torch.float64


def _batch():
    """Two sequences: lengths 3 and 2 (one padding token). log pi - log pi_old per token:
    seq 0: [0.1, -0.2, 0.4] -> mean 0.1; seq 1: [0.3, 0.5, (pad: 9.0, must be ignored)] -> mean 0.4."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.1, -3.0]], dtype=F64)
    new = old + torch.tensor([[0.1, -0.2, 0.4], [0.3, 0.5, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    return new, old, mask


def test_token_and_sequence_ratios_by_hand():
    new, old, mask = _batch()
    token = log_importance_weights(new, old, mask, "token")
    assert torch.allclose(token, new - old)
    sequence = log_importance_weights(new, old, mask, "sequence")
    assert sequence.shape == (2, 1)
    assert torch.allclose(sequence.squeeze(-1), torch.tensor([0.1, 0.4], dtype=F64))  # padding ignored
    gspo_token = log_importance_weights(new, old, mask, "sequence_token")
    # Value: the sequence's log ratio on every token.
    assert torch.allclose(gspo_token, torch.tensor([[0.1] * 3, [0.4] * 3], dtype=F64))
    with pytest.raises(ValueError, match="importance_sampling_level must be one of"):
        log_importance_weights(new, old, mask, "segment")


def test_gspo_token_gradient_is_per_token_and_sequence_gradient_is_averaged():
    """d s_i / d logp_it: GSPO (sequence) = s_i / |y_i| for every token; GSPO-token = s_i (sg on the ratio)."""
    new, old, mask = _batch()
    for level, expected_scale in (("sequence", lambda n: 1.0 / n), ("sequence_token", lambda n: 1.0)):
        logps = new.clone().requires_grad_(True)
        ratio = torch.exp(log_importance_weights(logps, old, mask, level))
        if level == "sequence":
            ratio.sum().backward()  # one s_i per sequence
        else:
            (ratio * mask).sum().backward()  # s_i's value on each real token, each with its own gradient
        s = torch.exp(torch.tensor([0.1, 0.4], dtype=F64))
        lengths = torch.tensor([3.0, 2.0], dtype=F64)
        expected = (s * torch.tensor([expected_scale(n) for n in lengths.tolist()], dtype=F64)).unsqueeze(-1) * mask
        assert torch.allclose(logps.grad, expected), level


def test_clipping_on_both_sides_with_the_gspo_epsilons():
    """GSPO: eps_low 3e-4, eps_high 4e-4. Sequence ratios exp(0.1) ~ 1.105 and exp(-0.1) ~ 0.905 are far outside.
    A>0, r>1+eps: the clipped term (1+eps) A is the min -> loss -(1+eps)A, no gradient. A<0, r<1-eps: the min is
    the clipped (1-eps) A -> loss -(1-eps) A, no gradient."""
    old = torch.zeros(2, 2, dtype=F64)
    logps = torch.tensor([[0.1, 0.1], [-0.1, -0.1]], dtype=F64, requires_grad=True)
    mask = torch.ones(2, 2, dtype=F64)
    advantages = torch.tensor([1.0, -1.0], dtype=F64)
    loss, stats = clipped_policy_loss(logps, old, advantages, mask, 3e-4, 4e-4, level="sequence")
    expected = (-(1 + 4e-4) * 1.0 + -(1 - 3e-4) * -1.0) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    loss.backward()
    assert torch.count_nonzero(logps.grad) == 0
    assert stats["clip_ratio/high"].item() == 0.5 and stats["clip_ratio/low"].item() == 0.5


def test_unclipped_gradient_direction_raises_good_sequences():
    """Inside the clip range the gradient of -r A w.r.t. log pi is -r A / |y| per token (sequence level): negative
    for A > 0, so gradient descent raises log pi of the better sequence and lowers the worse one's."""
    new, old, mask = _batch()
    logps = old.clone().requires_grad_(True)  # ratio exactly 1: inside any clip range
    advantages = torch.tensor([1.0, -1.0], dtype=F64)
    loss, _ = clipped_policy_loss(logps, old, advantages, mask, 0.2, 0.2, level="sequence")
    loss.backward()
    # sequence_mean aggregation: loss = mean_i(-s_i A_i); d/dlogp_it = -A_i / |y_i| / B
    expected = torch.tensor([[-1 / 3 / 2] * 3, [1 / 2 / 2, 1 / 2 / 2, 0.0]], dtype=F64)
    assert torch.allclose(logps.grad, expected)
    assert loss.item() == pytest.approx(0.0, abs=1e-12)  # (-1 + 1) / 2


def test_token_level_aggregations_weight_lengths_differently():
    """Token ratios 1 (no change), A = [1, 2], lengths 3 and 2: sequence_mean = mean(-1, -2) = -1.5;
    token_mean = (3 * -1 + 2 * -2) / 5 = -1.4 (the longer sequence weighs more)."""
    _, old, mask = _batch()
    advantages = torch.tensor([1.0, 2.0], dtype=F64)
    by_sequence, _ = clipped_policy_loss(old, old, advantages, mask, 0.2, 0.2, aggregation="sequence_mean")
    by_token, _ = clipped_policy_loss(old, old, advantages, mask, 0.2, 0.2, aggregation="token_mean")
    assert by_sequence.item() == pytest.approx(-1.5) and by_token.item() == pytest.approx(-1.4)
    with pytest.raises(ValueError, match="aggregation must be"):
        clipped_policy_loss(old, old, advantages, mask, 0.2, 0.2, aggregation="sum")


def test_padding_never_changes_the_loss():
    new, old, mask = _batch()
    advantages = torch.tensor([0.5, -0.5], dtype=F64)
    for level in ("token", "sequence", "sequence_token"):
        base, _ = clipped_policy_loss(new, old, advantages, mask, 0.2, 0.28, level=level)
        changed = new.clone()
        changed[1, 2] = -50.0  # the padded position
        other, _ = clipped_policy_loss(changed, old, advantages, mask, 0.2, 0.28, level=level)
        assert base.item() == pytest.approx(other.item(), abs=1e-12), level
        assert math.isfinite(base.item())
