"""old_logprobs_from_loss_pass: vLLM's importance-sampling correction computed in the loss pass, without TRL's
separate old-policy pass, gives TRL's numbers (losses, ratios, gaps), and only where it is valid."""

import math

import pytest
import torch

from trlx_scale import GRPOTrainer
from trlx_scale.losses.vllm_importance_sampling import importance_sampling_statistics, vllm_importance_sampling_ratio
from trlx_scale.tasks import addition_dataset, exact_match_reward

from .helpers.trainers import logged, small_grpo_config

SAMPLING_KEYS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


def test_ratio_modes_by_hand():
    """old - sampling = [0.1, -0.2, NaN (vLLM could not score it)] on 3 completion tokens, and a padding token:
    - token_truncate, clip_max 1.05: exp(0.1) = 1.105 -> 1.05; exp(-0.2) = 0.8187; NaN -> difference 0 -> 1; the
      padding token's difference is masked to 0 -> 1.
    - sequence_mask, clip_max 1.05: exp(0.1 - 0.2 + 0) = exp(-0.1) = 0.9048, inside the bounds -> kept; with clip_min
      0.95 it is outside -> 0.
    - statistics: gap mean over the scored tokens (0.1 + 0.2) / 2 = 0.15, max 0.2."""
    sampling = torch.tensor([[-1.0, -1.0, float("nan"), -1.0]])
    old = torch.tensor([[-0.9, -1.2, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    token = vllm_importance_sampling_ratio(old, sampling, mask, "token_truncate", None, 1.05)
    assert token.tolist()[0] == pytest.approx([1.05, math.exp(-0.2), 1.0, 1.0], abs=1e-6)
    sequence = vllm_importance_sampling_ratio(old, sampling, mask, "sequence_mask", None, 1.05)
    assert sequence.shape == (1, 1) and sequence.item() == pytest.approx(math.exp(-0.1), abs=1e-6)
    assert vllm_importance_sampling_ratio(old, sampling, mask, "sequence_mask", 0.95, 1.05).item() == 0.0
    stats = importance_sampling_statistics(old, sampling, token, mask, "token_truncate")
    assert stats["gap_mean"].item() == pytest.approx(0.15, abs=1e-6) and stats["gap_max"].item() == pytest.approx(0.2)
    assert stats["ratio_min"].item() == pytest.approx(math.exp(-0.2), abs=1e-6)
    assert stats["ratio_max"].item() == pytest.approx(1.05)
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be one of"):
        vllm_importance_sampling_ratio(old, sampling, mask, "tokens", None, 2.0)


def _run(default_model_dir, tmp_path, **overrides) -> GRPOTrainer:
    # A bf16 engine beside the fp32 trainer: the log-prob gap is ~1e-3, so the ratios are not all 1 and comparing
    # the two paths means something.
    values = dict(max_steps=3, learning_rate=5e-3, seed=11, use_vllm=True, vllm_dtype="auto", shared_prefix="false")
    values.update(overrides)
    trainer = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=small_grpo_config(tmp_path / "out", **values),
        train_dataset=addition_dataset("train", size=64),
    )
    trainer.train()
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sequence_mask", "token_truncate"])
def test_loss_pass_correction_equals_trls_old_pass(default_model_dir, tmp_path, mode):
    ours = _run(default_model_dir, tmp_path / "ours", vllm_importance_sampling_mode=mode)
    trls = _run(
        default_model_dir, tmp_path / "trl", vllm_importance_sampling_mode=mode, old_logprobs_from_loss_pass=False
    )
    assert ours._defers_old_logprobs() and not trls._defers_old_logprobs()
    # TRL's path runs the old-policy pass every step; ours never does.
    assert len(logged(trls, "time/old_logprobs")) == 3 and logged(ours, "time/old_logprobs") == []
    assert max(logged(trls, "sampling/sampling_logp_difference/max")) > 1e-4  # a real gap: ratios differ from 1
    for key in SAMPLING_KEYS:
        assert logged(ours, key) == pytest.approx(logged(trls, key), abs=2e-6), key
    assert logged(ours, "loss") == pytest.approx(logged(trls, "loss"), rel=1e-4, abs=1e-7)
    assert logged(ours, "reward") == logged(trls, "reward")  # the same completions were sampled


def test_unaligned_runs_keep_trls_old_pass(default_model_dir, tmp_path):
    """Two micro-batches per generation but one per optimizer step: the second loss pass runs with updated weights,
    so the old log-probs must come from TRL's pass."""
    trainer = _run(
        default_model_dir, tmp_path, max_steps=2, steps_per_generation=2, gradient_accumulation_steps=1,
        per_device_train_batch_size=4,
    )  # fmt: skip
    assert not trainer._defers_old_logprobs()
    # One generation for the two steps: TRL's pass ran for it and TRL logged its correction.
    assert len(logged(trainer, "time/old_logprobs")) == 1
    assert len(logged(trainer, "sampling/importance_sampling_ratio/mean")) == 1
