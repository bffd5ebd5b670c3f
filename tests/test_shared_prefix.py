"""Shared-prefix log-prob pass: grouping, exactness against TRL's duplicated pass, the `shared_prefix` setting.

Tolerances: fp32 log-probs within 1e-5 relative. fp32 gradients within 1e-5 of the gradient's norm: per parameter,
TRL's own fp32 pass is ~1e-4 away from the float64 result for the attention projections whose gradient is tiny
(cancellation), so per-parameter agreement is checked in float64 (1e-6), where rounding cannot hide a real mismatch.
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from trlx_scale import GRPOTrainer
from trlx_scale.compat.checkpoint_with_cache import FLAG, checkpointed_cache_supported
from trlx_scale.passes.shared_prefix import (
    find_prompt_groups,
    shared_prefix_logps,
    shared_token_ratio,
    unsupported_reason,
)
from trlx_scale.tasks import addition_dataset, exact_match_reward

from .helpers.trainers import small_grpo_config

PROMPT_LEN, COMPLETION_LEN = 9, 6


def _batch(num_generations: int, prompt_lengths=(9, 5, 2), seed: int = 0):
    """Left-padded prompts of different lengths, each with `num_generations` right-padded completions of different
    lengths; rows shuffled so that a group's rows are not adjacent (grouping is by content)."""
    generator = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    for length in prompt_lengths:
        prompt = torch.randint(5, 250, (length,), generator=generator)
        for g in range(num_generations):
            completion = torch.randint(5, 250, (COMPLETION_LEN,), generator=generator)
            kept = COMPLETION_LEN - (g % COMPLETION_LEN)
            pad = PROMPT_LEN - length
            rows.append(torch.cat([torch.zeros(pad, dtype=torch.long), prompt, completion]))
            masks.append(torch.cat([torch.zeros(pad), torch.ones(length), torch.ones(kept), torch.zeros(6 - kept)]))
    order = torch.randperm(len(rows), generator=generator)
    return torch.stack(rows)[order], torch.stack(masks).long()[order]


def _model(default_model_dir, dtype, lora=False, checkpointing=False):
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=dtype)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))  # as GRPOTrainer does, before PEFT
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        with torch.no_grad():  # B starts at zero: give the adapter a real effect so its gradients are not trivial
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    return model


def _duplicated(model, ids, mask):
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-COMPLETION_LEN] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -COMPLETION_LEN:], out.entropy[:, -COMPLETION_LEN:]


def _shared(model, ids, mask):
    return shared_prefix_logps(model, ids, mask, COMPLETION_LEN, compute_entropy=True)


def _pass(model, forward, ids, mask):
    """Log-probs, entropies and the gradients of a loss that uses both (as GRPO's loss and entropy bonus do)."""
    model.zero_grad()
    logps, entropy = forward(model, ids, mask)
    completion_mask = mask[:, -COMPLETION_LEN:]
    weights = torch.linspace(-1, 1, ids.size(0), dtype=logps.dtype)[:, None]  # signed, like advantages
    ((logps * weights + 0.1 * entropy) * completion_mask).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), entropy.detach(), grads


def test_find_prompt_groups_groups_by_content_in_order_of_first_row():
    ids = torch.tensor([[0, 7, 8], [5, 7, 8], [0, 7, 8], [5, 7, 8], [0, 0, 8]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 0, 1]])
    groups = find_prompt_groups(ids, mask)
    assert groups.first_row.tolist() == [0, 1, 4]
    assert groups.row_group.tolist() == [0, 1, 0, 1, 2]
    # A padded position counts as padding whatever token id it holds.
    assert find_prompt_groups(torch.tensor([[0, 8], [9, 8]]), torch.tensor([[0, 1], [0, 1]])).num_groups == 1


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fp32_logps_and_gradients_match_the_duplicated_pass(default_model_dir, lora, checkpointing):
    ids, mask = _batch(num_generations=4)
    model = _model(default_model_dir, torch.float32, lora=lora, checkpointing=checkpointing)
    logps_dup, entropy_dup, grads_dup = _pass(model, _duplicated, ids, mask)
    logps, entropy, grads = _pass(model, _shared, ids, mask)
    assert vars(model.get_base_model() if lora else model).get(FLAG) is None  # the compat flag was removed again
    completion = mask[:, -COMPLETION_LEN:].bool()
    torch.testing.assert_close(logps[completion], logps_dup[completion], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy[completion], entropy_dup[completion], rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_dup.keys() and grads  # the same parameters receive gradients
    if lora:
        assert all("lora_" in name for name in grads)
    diff = torch.sqrt(sum(((grads[n] - grads_dup[n]) ** 2).sum() for n in grads))
    norm = torch.sqrt(sum((g**2).sum() for g in grads_dup.values()))
    assert diff / norm < 1e-5, float(diff / norm)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_float64_every_parameter_gradient_matches(default_model_dir, lora):
    ids, mask = _batch(num_generations=3, seed=1)
    model = _model(default_model_dir, torch.float64, lora=lora)
    logps_dup, _, grads_dup = _pass(model, _duplicated, ids, mask)
    logps, _, grads = _pass(model, _shared, ids, mask)
    completion = mask[:, -COMPLETION_LEN:].bool()
    torch.testing.assert_close(logps[completion], logps_dup[completion], rtol=1e-12, atol=1e-12)
    for name, grad in grads_dup.items():
        relative = (grads[name] - grad).norm() / grad.norm()
        assert relative < 1e-6, (name, float(relative))


def test_a_wrong_prefix_state_would_be_caught(default_model_dir):
    """The comparison above can fail: giving every row the first group's prompt states changes the log-probs."""
    ids, mask = _batch(num_generations=2)
    model = _model(default_model_dir, torch.float32)
    with torch.no_grad():
        reference, _ = _duplicated(model, ids, mask)
        wrong_ids = ids.clone()
        wrong_ids[:, : PROMPT_LEN - 1] = ids[0, : PROMPT_LEN - 1]
        wrong_mask = mask.clone()
        wrong_mask[:, : PROMPT_LEN - 1] = mask[0, : PROMPT_LEN - 1]
        wrong, _ = shared_prefix_logps(model, wrong_ids, wrong_mask, COMPLETION_LEN)
    completion = mask[:, -COMPLETION_LEN:].bool()
    assert (wrong[completion] - reference[completion]).abs().max() > 1e-2


def test_nothing_to_share_returns_none_and_the_token_ratio_counts_the_saving(default_model_dir):
    model = _model(default_model_dir, torch.float32)
    ids, mask = _batch(num_generations=1)  # G=1: every prompt once
    assert shared_prefix_logps(model, ids, mask, COMPLETION_LEN) is None
    assert shared_token_ratio(ids, mask, COMPLETION_LEN) == 1.0
    ids, mask = _batch(num_generations=8, prompt_lengths=(9, 9))
    # 16 rows x 15 columns duplicated; shared: 2 prompts x 8 prefix columns + 16 rows x 7 columns.
    assert shared_token_ratio(ids, mask, COMPLETION_LEN) == pytest.approx(16 * 15 / (2 * 8 + 16 * 7))


def test_unsupported_models_and_settings_are_named(default_model_dir):
    model = AutoModelForCausalLM.from_pretrained(default_model_dir)
    assert unsupported_reason(model) is None
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert "use_reentrant" in unsupported_reason(model)
    sliding = copy.deepcopy(model.config)
    sliding.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    assert "non-full-attention" in unsupported_reason(AutoModelForCausalLM.from_config(sliding))


def test_transformers_still_lets_read_only_caches_through_checkpointed_layers():
    """The compat module relies on GradientCheckpointingLayer consulting `_can_checkpoint_with_cache`."""
    assert checkpointed_cache_supported()


def _trainer(default_model_dir, tmp_path, **overrides):
    args = small_grpo_config(tmp_path, **overrides)
    return GRPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=addition_dataset("train", size=16),
    )


def test_trainer_pass_matches_trl_pass_and_reports_the_ratio(default_model_dir, tmp_path):
    # The KV-cache pass chunk by chunk, on padded rows (with packed rows a batch may take the prefix tree, one
    # ratio per pass: tests/test_packing.py).
    trainer = _trainer(default_model_dir, tmp_path, shared_prefix="true", padding_free=False)
    ids, mask = _batch(num_generations=4)
    trainer.model.train()
    shared, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, COMPLETION_LEN, batch_size=4)
    assert trainer.logprob_passes.shared_prefix_decision is True
    trainer.logprob_passes.shared_prefix_decision = False  # TRL's own pass, same model
    plain, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, COMPLETION_LEN, batch_size=4)
    completion = mask[:, -COMPLETION_LEN:].bool()
    torch.testing.assert_close(shared[completion], plain[completion], rtol=1e-5, atol=1e-6)
    ratios = trainer._metrics["train"]["shared_prefix/token_ratio"]
    # 3 chunks of 4 shuffled rows: chunks with a repeated prompt save tokens, the others take TRL's path (1.0).
    assert len(ratios) == 3 and max(ratios) > 1.0


def test_trainer_trains_with_shared_prefix_and_logs_it(default_model_dir, tmp_path):
    trainer = _trainer(default_model_dir, tmp_path, shared_prefix="true", per_device_train_batch_size=8)
    trainer.train()
    ratios = [
        entry["shared_prefix/token_ratio"]
        for entry in trainer.state.log_history
        if "shared_prefix/token_ratio" in entry
    ]
    assert len(ratios) == 2 and all(r > 1.5 for r in ratios)  # 2 prompts x 4 completions per step
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)


def test_auto_explains_why_it_is_off_and_true_refuses(default_model_dir, tmp_path):
    reentrant = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}
    trainer = _trainer(default_model_dir, tmp_path / "auto", shared_prefix="auto", **reentrant)
    trainer.train()
    assert (
        trainer.logprob_passes.shared_prefix_decision is False
        and "use_reentrant" in trainer.logprob_passes.shared_prefix_off_reason
    )
    assert not [e for e in trainer.state.log_history if "shared_prefix/token_ratio" in e]
    single = _trainer(default_model_dir, tmp_path / "g1", shared_prefix="auto", num_generations=2)
    single.num_generations = 1  # G=1 (TRL's config refuses it for GRPO, but subclasses reuse the pass)
    assert (
        not single.logprob_passes.shared_prefix_enabled(single.model)
        and "num_generations=1" in single.logprob_passes.shared_prefix_off_reason
    )
    strict = _trainer(default_model_dir, tmp_path / "true", shared_prefix="true", **reentrant)
    with pytest.raises(ValueError, match="shared_prefix='true' cannot run: gradient checkpointing is reentrant"):
        strict.train()


def test_fsdp1_is_refused_and_fsdp2_allowed(default_model_dir, tmp_path):
    """FSDP2 is verified with the shared pass (tests/test_shared_prefix_sharded.py, raw fully_shard); FSDP1 is not,
    and the reason names the fix. (Accelerate runs FSDP only on accelerators: its state is stood in for.)"""
    from types import SimpleNamespace

    trainer = _trainer(default_model_dir, tmp_path, shared_prefix="true")
    real = trainer.accelerator
    trainer.is_fsdp_enabled = True
    try:
        trainer.accelerator = SimpleNamespace(is_fsdp2=False, unwrap_model=real.unwrap_model)
        assert "set fsdp_version: 2" in trainer.logprob_passes.shared_prefix_blocker(trainer.model, auto=False)
        trainer.accelerator = SimpleNamespace(is_fsdp2=True, unwrap_model=real.unwrap_model)
        assert trainer.logprob_passes.shared_prefix_blocker(trainer.model, auto=False) is None
    finally:
        trainer.accelerator, trainer.is_fsdp_enabled = real, False
