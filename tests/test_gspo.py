"""GSPO in GRPOTrainer: the recipe, the guard rails, and GSPO-token wired through TRL's loss."""

import pytest
import torch

from trlx_scale import GRPOConfig, GRPOTrainer
from trlx_scale.tasks import addition_dataset, exact_match_reward

from .helpers.policy_loss_reference import clipped_policy_loss
from .helpers.trainers import small_grpo_config


def test_gspo_recipe_sets_the_paper_values_and_user_values_win(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), bf16=False, loss_recipe="gspo")
    assert args.importance_sampling_level == "sequence" and args.loss_type == "grpo"
    assert (args.epsilon, args.epsilon_high, args.beta) == (3e-4, 4e-4, 0.0)
    mine = GRPOConfig(
        output_dir=str(tmp_path), bf16=False, loss_recipe="gspo", importance_sampling_level="sequence_token"
    )
    assert mine.importance_sampling_level == "sequence_token"
    assert mine.loss_recipe_values["importance_sampling_level"] == ("sequence_token", "user")
    with pytest.raises(ValueError, match="loss_recipe must be one of"):
        GRPOConfig(output_dir=str(tmp_path), bf16=False, loss_recipe="gspo2")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss_type": "dapo"}, "weights every sequence by its length"),
        ({"loss_type": "grpo", "beta": 0.04}, "supports loss_type='grpo' with beta=0.0"),
        ({"loss_type": "bnpo"}, "weights every sequence by its length"),
    ],
)
def test_sequence_token_refuses_combinations_it_would_get_wrong(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(output_dir=str(tmp_path), bf16=False, importance_sampling_level="sequence_token", **overrides)
    with pytest.raises(ValueError, match="importance_sampling_level must be one of"):
        GRPOConfig(output_dir=str(tmp_path), bf16=False, importance_sampling_level="segment")


def _loss_and_grads(default_model_dir, tmp_path, level, inputs):
    args = small_grpo_config(tmp_path / level, importance_sampling_level=level, loss_type="grpo", epsilon=0.2, seed=0)
    trainer = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=addition_dataset("train", size=16),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); one micro-batch here
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    # GSPO-token runs TRL's token branch on shifted log-probs; the level is mapped once, at start (no per-call flip).
    assert trainer.uses_sequence_token_ratios == (level == "sequence_token")
    assert trainer.importance_sampling_level == ("token" if level == "sequence_token" else level)
    return loss.detach(), grads


def test_gspo_token_matches_gspo_with_sequence_advantages_and_differs_from_token(default_model_dir, tmp_path):
    """With one advantage per sequence, GSPO-token's loss and gradient equal GSPO's (the paper's equivalence); the
    token-level ratio gives a different loss, so the wiring really changes what TRL computes."""
    prompt_ids = torch.tensor([[0, 3, 40, 41], [3, 42, 43, 44]])
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    completion_ids = torch.tensor([[50, 51, 1], [52, 1, 0]])
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    generator = torch.Generator().manual_seed(0)
    # Behaviour-policy log-probs a little off the current ones, so the ratios differ from 1 but stay unclipped.
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(default_model_dir)
    with torch.no_grad():
        logits = reference(
            input_ids=torch.cat([prompt_ids, completion_ids], 1),
            attention_mask=torch.cat([prompt_mask, completion_mask], 1),
        ).logits[:, prompt_ids.shape[1] - 1 : -1]
        current = torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    old = current + 0.05 * torch.randn(current.shape, generator=generator)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5]),
        "old_per_token_logps": old,
    }
    sequence_loss, sequence_grads = _loss_and_grads(default_model_dir, tmp_path, "sequence", inputs)
    gspo_token_loss, gspo_token_grads = _loss_and_grads(default_model_dir, tmp_path, "sequence_token", inputs)
    token_loss, _ = _loss_and_grads(default_model_dir, tmp_path, "token", inputs)
    assert torch.allclose(sequence_loss, gspo_token_loss, atol=1e-6)
    assert sequence_grads.keys() == gspo_token_grads.keys() and sequence_grads
    for name in sequence_grads:
        assert torch.allclose(sequence_grads[name], gspo_token_grads[name], atol=1e-6, rtol=1e-4), name
    assert abs(token_loss.item() - sequence_loss.item()) > 1e-4
    # And TRL's numbers equal the pure functions' (losses/policy_losses.py) on the same log-probs.
    for level, trainer_loss in (
        ("sequence", sequence_loss),
        ("sequence_token", gspo_token_loss),
        ("token", token_loss),
    ):
        expected, _ = clipped_policy_loss(
            current, old, inputs["advantages"], completion_mask.float(), 0.2, 0.2, level=level
        )
        assert torch.allclose(trainer_loss, expected, atol=1e-6), level


def test_gspo_token_trains_with_the_colocated_engine(default_model_dir, tmp_path):
    args = small_grpo_config(
        tmp_path / "run",
        loss_recipe="gspo",
        importance_sampling_level="sequence_token",
        use_vllm=True,
        vllm_dtype="trainer",
        learning_rate=1e-3,
        per_device_train_batch_size=32,  # 8 groups: some with mixed rewards, so advantages are not all zero
        max_steps=3,
    )
    trainer = GRPOTrainer(
        model=default_model_dir,
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=addition_dataset("train", size=32),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert (
        trainer.state.global_step == 3
        and trainer.uses_sequence_token_ratios
        and trainer.args.importance_sampling_level == "sequence_token"
    )
    assert (
        min(entry["frac_reward_zero_std"] for entry in trainer.state.log_history if "frac_reward_zero_std" in entry)
        < 1
    )
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
