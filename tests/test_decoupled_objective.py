"""The decoupled off-policy objective's reference (tests/helpers/decoupled_objective.py, what the asynchronous
trainer's loss is held to) and the package's behaviour KL, values derived by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trlx_scale.losses.vllm_importance_sampling import behaviour_kl

from .helpers.decoupled_objective import behaviour_weights, decoupled_policy_loss
from .helpers.policy_loss_reference import clipped_policy_loss


def test_same_policies_give_the_plain_clipped_surrogate():
    torch.manual_seed(0)
    logps = torch.randn(3, 5, requires_grad=True)
    prox = (logps.detach() + 0.1 * torch.randn(3, 5)).requires_grad_(False)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    advantages = torch.tensor([1.0, -0.5, 2.0])
    for level in ("token", "sequence"):
        loss, stats = decoupled_policy_loss(logps, prox, prox.clone(), advantages, mask, 0.2, 0.28, ratio_level=level)
        plain, _ = clipped_policy_loss(logps, prox, advantages, mask, 0.2, 0.28, level=level)
        assert torch.equal(loss, plain)
        assert stats["behaviour_weight_clip_frac"].item() == 0.0
        assert stats["behaviour_kl"].item() == 0.0


def test_token_weights_by_hand():
    """log pi_prox - log pi_behave = [ln 3, ln 0.5, ln 5 (padding)]; cap 2. Truncate: [2, 0.5]; mask: [0, 0.5]. One
    of the two real tokens is over the cap: fraction 0.5 (the padding's 5 is not counted)."""
    behave = torch.zeros(1, 3)
    prox = torch.tensor([[math.log(3.0), math.log(0.5), math.log(5.0)]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    truncated, fraction = behaviour_weights(prox, behave, mask, "token", "truncate", cap=2.0)
    assert torch.allclose(truncated[:, :2], torch.tensor([[2.0, 0.5]]))
    assert fraction.item() == 0.5
    masked, _ = behaviour_weights(prox, behave, mask, "token", "mask", cap=2.0)
    assert torch.allclose(masked[:, :2], torch.tensor([[0.0, 0.5]]))


def test_sequence_weight_is_the_geometric_mean_by_hand():
    """Token log-weights [ln 4, 0] -> mean ln 2 -> weight 2 (the product would be 4). Cap 1.5 truncates it to 1.5,
    and the one sequence counts as bounded: fraction 1."""
    prox = torch.tensor([[math.log(4.0), 0.0]])
    behave = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    weight, fraction = behaviour_weights(prox, behave, mask, "sequence", "truncate", cap=3.0)
    assert weight.shape == (1, 1) and abs(weight.item() - 2.0) < 1e-6 and fraction.item() == 0.0
    weight, fraction = behaviour_weights(prox, behave, mask, "sequence", "truncate", cap=1.5)
    assert abs(weight.item() - 1.5) < 1e-6 and fraction.item() == 1.0


def test_loss_and_gradient_by_hand():
    """pi_theta = pi_prox (every ratio 1, nothing clipped), A = 1, token weights [2, 0.5] (truncated from [3, 0.5]).
    Per-token loss -A * w * r = [-2, -0.5]; sequence mean: -1.25. d loss / d log pi_theta = -A * w * r / T =
    [-1, -0.25]. The weights carry no gradient to pi_prox or pi_behave."""
    prox = torch.tensor([[math.log(3.0), math.log(0.5)]], requires_grad=True)
    behave = torch.zeros(1, 2, requires_grad=True)
    logps = prox.detach().clone().requires_grad_(True)
    loss, stats = decoupled_policy_loss(logps, prox, behave, torch.tensor([1.0]), torch.ones(1, 2), 0.2, 0.2)
    assert abs(loss.item() - (-1.25)) < 1e-6
    loss.backward()
    assert torch.allclose(logps.grad, torch.tensor([[-1.0, -0.25]]))
    assert prox.grad is None or torch.count_nonzero(prox.grad) == 0
    assert behave.grad is None
    assert stats["behaviour_weight_clip_frac"].item() == 0.5


def test_behaviour_kl_by_hand():
    """r = pi_prox / pi_behave = 3 and 0.5: k3 = r - 1 - ln r = 0.90139 and 0.19315, mean 0.54727."""
    prox = torch.tensor([[math.log(3.0), math.log(0.5)]])
    kl = behaviour_kl(prox, torch.zeros(1, 2), torch.ones(1, 2))
    assert abs(kl.item() - 0.547267) < 1e-5


def test_the_weight_bounds_a_stale_samples_gradient():
    """A sample whose behaviour probability was 100x lower than the proximal one (a stale, far sampler): uncorrected
    (pi_behave as the ratio's denominator) the surrogate's gradient is 100 x A; decoupled and truncated at 2 it is
    at most 2 x A."""
    behave = torch.tensor([[math.log(0.001)]])
    prox = torch.tensor([[math.log(0.1)]])
    logps = prox.clone().requires_grad_(True)
    advantages, mask = torch.tensor([1.0]), torch.ones(1, 1)
    plain, _ = clipped_policy_loss(logps, behave, advantages, mask, 0.2, 1e9)
    (plain_grad,) = torch.autograd.grad(plain, logps)
    decoupled, _ = decoupled_policy_loss(logps, prox, behave, advantages, mask, 0.2, 1e9, weight_cap=2.0)
    (decoupled_grad,) = torch.autograd.grad(decoupled, logps)
    assert abs(plain_grad.item() + 100.0) < 1e-3
    assert abs(decoupled_grad.item() + 2.0) < 1e-5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"level": "tokens"}, "level must be one of"),
        ({"mode": "clip"}, "mode must be one of"),
        ({"cap": 0.5}, "cap must be at least 1"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        behaviour_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), **kwargs)


def test_padding_the_engine_left_nan_changes_nothing():
    """The engine's log-probs of padding positions may be NaN: the weights, the KL and the loss are those of the
    real tokens alone (a product with the mask would have made them NaN)."""
    prox = torch.tensor([[math.log(3.0), math.log(0.5), 0.0]])
    behave = torch.tensor([[0.0, 0.0, float("nan")]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    for level in ("token", "sequence"):
        weights, _ = behaviour_weights(prox, behave, mask, level=level, cap=2.0)
        clean, _ = behaviour_weights(prox, torch.zeros(1, 3), mask, level=level, cap=2.0)
        assert torch.equal(weights, clean), level
    assert abs(behaviour_kl(prox, behave, mask).item() - 0.547267) < 1e-5
    logps = prox.clone().requires_grad_(True)
    loss, _ = decoupled_policy_loss(logps, prox, behave, torch.tensor([1.0]), mask, 0.2, 0.2)
    assert abs(loss.item() - (-1.25)) < 1e-6


def test_the_trainers_geometric_mean_sequence_weight_is_the_reference_one():
    """losses/vllm_importance_sampling.py's sequence weight with sequence_normalisation="mean" (the asynchronous
    trainer's sequence_behaviour_weight="geometric_mean") is decoupled_objective's sequence weight; "sum" is TRL's
    product of the token ratios."""
    from trlx_scale.losses.vllm_importance_sampling import vllm_importance_sampling_ratio

    torch.manual_seed(0)
    prox, behave = torch.randn(4, 6) * 0.3, torch.randn(4, 6) * 0.3
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]]).float()
    mean = vllm_importance_sampling_ratio(prox, behave, mask, "sequence_truncate", None, 3.0, "mean")
    reference, _ = behaviour_weights(prox, behave, mask, "sequence", "truncate", cap=3.0)
    assert torch.allclose(mean, reference)
    product = vllm_importance_sampling_ratio(prox, behave, mask, "sequence_truncate", None, 3.0)
    expected = torch.exp(((prox - behave) * mask).sum(-1, keepdim=True)).clamp(max=3.0)
    assert torch.allclose(product, expected) and not torch.allclose(product, mean)
    with pytest.raises(ValueError, match="sequence_normalisation must be one of"):
        vllm_importance_sampling_ratio(prox, behave, mask, "sequence_truncate", None, 3.0, "median")
