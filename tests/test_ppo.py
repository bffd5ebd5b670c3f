"""PPO: the pure pieces against values computed by hand, the four roles, memory of the critic modes, training."""

import math

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from trlx_scale import PPOConfig, PPOTrainer
from trlx_scale.losses import clipped_value_loss
from trlx_scale.ppo import AdaptiveKLController, gae, kl_penalty_rewards, masked_whiten, per_token_kl
from trlx_scale.ppo.advantages import place_turn_rewards, turn_discounts, turn_ends
from trlx_scale.tasks import addition_dataset, exact_match_reward

from .helpers.trainers import logged, small_grpo_config

# ---------------------------------------------------------------- pure functions, by hand


def test_gae_and_returns_match_the_definition_by_hand():
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0.0, 0.5, 1.0, 0.0], [2.0, -1.0, 0.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.4, 0.5, 9.0, 9.0]], dtype=torch.float64)  # 9.0: padding
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    # Row 0 (3 tokens): delta_t = r_t + gamma V_{t+1} - V_t, V after the last token = 0.
    d = [0.0 + gamma * 0.2 - 0.1, 0.5 + gamma * 0.3 - 0.2, 1.0 + 0.0 - 0.3]
    a0 = [d[0] + gamma * lam * d[1] + (gamma * lam) ** 2 * d[2], d[1] + gamma * lam * d[2], d[2], 0.0]
    # Row 1 (2 tokens).
    e = [2.0 + gamma * 0.5 - 0.4, -1.0 + 0.0 - 0.5]
    a1 = [e[0] + gamma * lam * e[1], e[1], 0.0, 0.0]
    expected = torch.tensor([a0, a1], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, (expected + values) * mask)


def test_gae_skips_observations_between_turns_as_if_they_were_not_there():
    """A multi-turn row (two turns with a tool result between them, then padding) gets the advantages and returns of
    the same row with the tool result removed, and zeros on the tool result; the score lands on the last sampled
    token, not at the count of sampled tokens (which would be inside the tool result)."""
    gamma, lam = 0.9, 0.8
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0]])
    values = torch.randn(1, 8, dtype=torch.float64)
    kl = torch.rand(1, 8, dtype=torch.float64)
    rewards = kl_penalty_rewards(torch.tensor([2.0], dtype=torch.float64), kl * mask, 0.1, mask)
    assert rewards[0, 6] == pytest.approx(-0.1 * kl[0, 6].item() + 2.0)
    assert (rewards[0, 2:5] == 0).all() and rewards[0, 7] == 0
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    kept = mask[0].bool()
    compact = gae(rewards[:, kept], values[:, kept], torch.ones(1, int(kept.sum())), gamma, lam)
    torch.testing.assert_close(advantages[:, kept], compact[0])
    torch.testing.assert_close(returns[:, kept], compact[1])
    assert (advantages[:, ~kept] == 0).all() and (returns[:, ~kept] == 0).all()
    # The first turn's advantage carries the score earned after the tool result.
    assert advantages[0, 0] != gae(rewards, values, torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0]]), gamma, lam)[0][0, 0]


def test_each_step_reward_lands_on_its_own_turn_and_turns_are_discounted_between_them():
    """step_reward_credit="own_turn": step k's reward on the last sampled token of turn k, the turn discount applied
    where one turn hands back to the previous; with lam=1 the returns are then, at every token of turn k, the
    discounted sum of the rewards of turn k and the later ones only."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
    assert turn_ends(mask) == [[1, 6, 8], [2]]
    placed = place_turn_rewards([[1.0, None, 4.0], [2.0, 5.0]], mask, weight=0.5)
    expected = torch.zeros(2, 10, dtype=torch.float64)
    expected[0, 1], expected[0, 8] = 0.5, 2.0
    expected[1, 2] = 0.5 * (2.0 + 5.0)  # more steps than turns: the rest on the last turn
    torch.testing.assert_close(placed, expected)
    discounts = turn_discounts(mask, 0.5)
    assert discounts[0].tolist() == [1, 0.5, 1, 1, 1, 1, 0.5, 1, 1, 1] and (discounts[1] == 1).all()
    values = torch.randn(2, 10, dtype=torch.float64)
    _, returns = gae(placed, values, mask, gamma=1.0, lam=1.0, discounts=discounts)
    first, second, third = 0.5 + 0.5 * (0.0 + 0.5 * 2.0), 0.0 + 0.5 * 2.0, 2.0
    torch.testing.assert_close(
        returns[0, [0, 1, 4, 5, 6, 8]], torch.tensor([first] * 2 + [second] * 3 + [third]).double()
    )
    # Without the per-turn factors, gae is the per-token one it always was.
    torch.testing.assert_close(
        gae(placed, values, mask, 0.9, 0.8, torch.ones(2, 10, dtype=torch.float64)),
        gae(placed, values, mask, 0.9, 0.8),
    )


def test_kl_estimators_and_penalized_rewards():
    logps = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    torch.testing.assert_close(per_token_kl(logps, ref, "k1"), torch.tensor([[0.5, -1.0, 0.0]]))
    log_r = ref - logps  # k3 = (r - 1) - log r, r = pi_ref / pi
    torch.testing.assert_close(per_token_kl(logps, ref, "k3"), torch.exp(log_r) - 1 - log_r)
    assert (per_token_kl(logps, ref, "k3") >= 0).all()
    kl = torch.tensor([[0.5, -1.0, 0.25], [0.1, 0.2, 0.3]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rewards = kl_penalty_rewards(torch.tensor([1.0, -2.0]), kl * mask, 0.1, mask)
    # The score lands on each row's last real token; every real token pays -0.1 * KL.
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1 + 1.0, 0.0], [-0.01, -0.02, -0.03 - 2.0]]))
    with pytest.raises(ValueError, match="kl_estimator"):
        per_token_kl(logps, ref, "k2")


def test_adaptive_kl_controller_update_rule():
    controller = AdaptiveKLController(value=0.2, target=6.0, horizon=10000)
    # KL 9 > target: error = clip(9/6 - 1, -0.2, 0.2) = 0.2; coef *= 1 + 0.2 * 256 / 10000.
    assert controller.update(9.0, 256) == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000))
    before = controller.value
    # KL 5.4 < target: error = -0.1.
    assert controller.update(5.4, 1000) == pytest.approx(before * (1 - 0.1 * 1000 / 10000))


def test_clipped_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0, 5.0]])
    old = torch.tensor([[0.5, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, clip_fraction = clipped_value_loss(values, old, returns, mask, cliprange_value=0.2)
    # token 0: unclipped (1-0)^2 = 1, clipped V = 0.5 + 0.2 = 0.7 -> 0.49; max = 1 (unclipped counts)
    # token 1: unclipped (0-1)^2 = 1, clipped V = 0 -> 1; max = 1; token 2 is padding.
    assert loss.item() == pytest.approx(0.5 * (1 + 1) / 2)
    assert clip_fraction.item() == 0.0
    values = torch.tensor([[0.0]])
    loss, clip_fraction = clipped_value_loss(values, torch.tensor([[1.0]]), torch.tensor([[2.0]]), torch.tensor([[1]]))
    # unclipped (0-2)^2 = 4, clipped V = 0.8 -> 1.44; max = 4, and clipping did not win.
    assert loss.item() == pytest.approx(2.0) and clip_fraction.item() == 0.0
    values = torch.tensor([[2.0]])
    loss, clip_fraction = clipped_value_loss(values, torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[1]]))
    # unclipped 4, clipped V = 1.2 -> 1.44: unclipped wins; and the gradient flows through the unclipped branch
    assert loss.item() == pytest.approx(2.0)


def test_masked_whitening_ignores_padding():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    whitened = masked_whiten(values, mask)
    real = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    expected = (real - real.mean()) / real.std()
    torch.testing.assert_close(whitened[mask.bool()], expected, atol=1e-6, rtol=1e-6)
    assert (whitened[~mask.bool()] == 0).all()


# ---------------------------------------------------------------- trainer


def _args(output_dir, **overrides):
    """The shared small config (tests/helpers/trainers.py) as a PPOConfig, with a critic learning rate."""
    return small_grpo_config(output_dir, PPOConfig, **{"critic_learning_rate": 1e-3, "seed": 11, **overrides})


LORA = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")


def _trainer(default_model_dir, tmp_path, peft=True, reward_funcs=exact_match_reward, **overrides):
    return PPOTrainer(
        model=default_model_dir,
        reward_funcs=reward_funcs,
        args=_args(tmp_path, **overrides),
        train_dataset=addition_dataset("train", size=32),
        peft_config=LORA if peft else None,
    )


def _base_storages(module) -> set[int]:
    return {p.data_ptr() for n, p in module.named_parameters() if "lora_" not in n and "summary" not in n}


def test_shared_base_critic_keeps_one_base_in_memory(default_model_dir, tmp_path):
    base_count = len(list(AutoModelForCausalLM.from_pretrained(default_model_dir).parameters()))
    shared = _trainer(default_model_dir, tmp_path / "shared", critic_mode="shared_base")
    storages = _base_storages(shared.model) | _base_storages(shared.critic)
    assert shared.ppo_ref_model is None  # reference = the base with adapters disabled
    assert len(storages) == base_count  # actor, critic and reference: one base
    assert {n.split(".")[-2] for n, _ in shared.model.named_parameters() if "lora_A" in n} == {"default", "critic"}
    separate = _trainer(default_model_dir, tmp_path / "separate", critic_mode="separate")
    storages = _base_storages(separate.model) | _base_storages(separate.critic.model)
    assert len(storages) == 2 * base_count  # the separate critic is a second model


def test_shared_base_critic_is_a_parameter_group_of_the_policy_optimizer(default_model_dir, tmp_path):
    """The shared-base critic's adapter and value head are the policy module's parameters (sharded and reduced with
    it): one optimizer, the critic in a group of its own at the critic's learning rate."""
    trainer = _trainer(default_model_dir, tmp_path, critic_mode="shared_base")
    trainer.create_optimizer()
    *policy_groups, critic_group = trainer.optimizer.param_groups
    policy_ids = {id(p) for group in policy_groups for p in group["params"]}
    critic_ids = {id(p) for p in trainer.critic.trainable_parameters()}
    assert policy_ids and critic_ids and not policy_ids & critic_ids
    assert {id(p) for p in critic_group["params"]} == critic_ids
    assert critic_group["lr"] == trainer.args.critic_learning_rate != policy_groups[0]["lr"]
    assert trainer.critic_training is None  # no second optimizer
    module_ids = {id(p) for p in trainer.model.parameters()}
    assert critic_ids <= module_ids  # the value head is registered on the policy's module
    assert all(p.requires_grad for p in trainer.critic.trainable_parameters())


def test_separate_critic_has_its_own_optimizer(default_model_dir, tmp_path):
    trainer = _trainer(default_model_dir, tmp_path, critic_mode="separate")
    trainer.create_optimizer()
    policy_ids = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    critic_ids = {id(p) for p in trainer.critic.trainable_parameters()}
    assert policy_ids and critic_ids and not policy_ids & critic_ids
    optimizer = trainer.critic_training.optimizer
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == critic_ids
    assert trainer.critic_training.backend == "single"


@pytest.mark.parametrize("critic_mode", ["separate", "shared_base"])
def test_training_steps_policy_and_critic_and_logs_ppo_metrics(default_model_dir, tmp_path, critic_mode):
    trainer = _trainer(
        default_model_dir, tmp_path, critic_mode=critic_mode, steps_per_generation=2, num_iterations=2, max_steps=4
    )
    critic_before = [p.detach().clone() for p in trainer.critic.trainable_parameters()]
    policy_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".default." in n}
    trainer.train()
    critic_after = trainer.critic.trainable_parameters()
    assert any(not torch.equal(a, b) for a, b in zip(critic_before, critic_after, strict=True))
    params = dict(trainer.model.named_parameters())
    assert any(not torch.equal(policy_before[n], params[n]) for n in policy_before)
    for key in ("ppo/kl", "ppo/kl_coef", "ppo/returns_mean", "ppo/explained_variance", "ppo/value_loss"):
        assert logged(trainer, key), key
    for key in ("ppo/approx_kl", "ppo/value_clipfrac", "entropy", "clip_ratio/region_mean", "reward"):
        assert logged(trainer, key), key
    assert all(math.isfinite(v) for v in logged(trainer, "ppo/value_loss"))
    assert len(logged(trainer, "ppo/kl")) == 1  # one rollout for 2 epochs x 2 mini-batches


def test_full_finetuning_uses_a_frozen_reference_copy(default_model_dir, tmp_path):
    trainer = _trainer(default_model_dir, tmp_path, peft=False)
    ref = trainer.ppo_ref_model
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())
    assert not _base_storages(ref) & _base_storages(trainer.model)
    trainer.train()
    initial = AutoModelForCausalLM.from_pretrained(default_model_dir).state_dict()
    assert all(torch.equal(initial[k], v) for k, v in ref.state_dict().items())  # the reference never moves


def test_early_stop_on_approximate_kl(default_model_dir, tmp_path):
    trainer = _trainer(
        default_model_dir,
        tmp_path,
        steps_per_generation=2,
        num_iterations=2,
        max_steps=4,
        target_kl=1e-12,
        learning_rate=1e-2,
    )
    trainer.train()
    # The first mini-batch has the rollout's own policy (KL 0); after an update the KL exceeds the tiny target and
    # the rest of the rollout is skipped, so a new rollout starts: more rollouts than the 1 of a full schedule.
    assert 1.0 in logged(trainer, "ppo/early_stopped")
    assert len(logged(trainer, "ppo/kl")) >= 2


def test_reward_model_scores_the_last_real_token(default_model_dir, tmp_path):
    """A sequence-classification reward model scores prompt + completion; padding must not move the score."""
    reward_model = AutoModelForSequenceClassification.from_pretrained(default_model_dir, num_labels=1)
    torch.manual_seed(0)
    torch.nn.init.normal_(reward_model.score.weight, std=1.0)
    trainer = _trainer(default_model_dir, tmp_path, reward_funcs=[reward_model])
    tokenizer = trainer.reward_processing_classes[0]
    inputs = [dict(row) for row in addition_dataset("train", size=4)]
    prompts = [row["prompt"] for row in inputs]
    completions = [[{"role": "assistant", "content": text}] for text in ("12", "3", "100", "7")]
    rewards = trainer._calculate_rewards(inputs, prompts, completions, [[1], [1], [1], [1]])[:, 0]
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        text = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():  # unpadded: the model's own last position
            alone = reward_model(**ids).logits[0, 0]
        assert rewards[i].item() == pytest.approx(alone.item(), abs=1e-4)
    assert len({round(r, 4) for r in rewards.tolist()}) > 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"beta": 0.04}, "Set beta=0 and use kl_coef"),
        ({"kl_estimator": "k2"}, "kl_estimator must be"),
        ({"critic_mode": "tied"}, "critic_mode must be"),
        ({"lam": 1.5}, "gamma and lam must lie in"),
        ({"step_reward_credit": "per_token"}, "step_reward_credit must be 'sequence_end' or 'own_turn'"),
    ],
)
def test_bad_config_is_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _args(tmp_path, **overrides)


def test_own_turn_credit_needs_a_gym_rollout(default_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"step_reward_credit='own_turn'.*needs rollout_func=GymRollout"):
        PPOTrainer(
            model=default_model_dir,
            reward_funcs=exact_match_reward,
            args=_args(tmp_path, step_reward_credit="own_turn"),
            train_dataset=addition_dataset("train", size=4),
        )


def test_shared_base_needs_a_lora_policy(default_model_dir, tmp_path):
    with pytest.raises(ValueError, match="critic_mode='shared_base' adds a critic adapter to a LoRA policy"):
        _trainer(default_model_dir, tmp_path, peft=False, critic_mode="shared_base")


def test_policy_and_reference_follow_the_requested_dtype(default_model_dir, tmp_path):
    """examples/ppo.py --dtype bfloat16 reaches the policy through model_init_kwargs; the frozen reference copy
    follows the policy's dtype (the critic and its value head stay fp32 without fp32_master_weights: docs/ppo.md)."""
    trainer = _trainer(default_model_dir, tmp_path, peft=False, model_init_kwargs={"dtype": "bfloat16"})
    assert trainer.model.dtype == torch.bfloat16
    assert trainer.ppo_ref_model.dtype == torch.bfloat16
    assert trainer.critic.head.summary.weight.dtype == torch.float32


def _shared_base_gradients(default_model_dir, tmp_path, checkpointing: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    trainer = _trainer(
        default_model_dir,
        tmp_path / str(checkpointing),
        critic_mode="shared_base",
        gradient_checkpointing=checkpointing,
    )
    if checkpointing:  # as the Trainer does when training starts
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    trainer.model.train()
    with torch.no_grad():  # both adapters away from their zero start, and a value head that sees them
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.01)
        trainer.critic.head.summary.weight.normal_()
    input_ids = torch.randint(3, 100, (2, 12))
    mask = torch.ones_like(input_ids)
    policy_term = trainer.model(input_ids=input_ids, attention_mask=mask).logits.float().mean()
    (trainer.critic.values(input_ids, mask).sum() + policy_term).backward()
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def test_shared_base_critic_gradients_are_the_same_with_gradient_checkpointing(default_model_dir, tmp_path):
    """Checkpointed layers recompute in the backward, when the policy's adapter is active again: the critic's forward
    must not be checkpointed, or its adapter gets gradients through the wrong adapter (off by O(10) before)."""
    plain = _shared_base_gradients(default_model_dir, tmp_path, checkpointing=False)
    checkpointed = _shared_base_gradients(default_model_dir, tmp_path, checkpointing=True)
    assert set(plain) == set(checkpointed) and any(".critic." in n for n in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_shared_base_refuses_ddp_unused_parameter_search(tmp_path):
    with pytest.raises(ValueError, match="leave ddp_find_unused_parameters unset"):
        _args(tmp_path, critic_mode="shared_base", ddp_find_unused_parameters=True)
    assert _args(tmp_path, critic_mode="shared_base").ddp_find_unused_parameters is False


def test_separate_critic_freezes_an_untied_lm_head():
    """The value head reads hidden states: an untied LM head would be a trainable parameter no loss reaches (Adam
    state for nothing, and a DDP error); a tied one is the input embedding and stays trainable."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trlx_scale.ppo.critic import SeparateCritic

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=50)
    untied = SeparateCritic(LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False)))
    names = set(untied.named_trainable_parameters())
    assert "model.lm_head.weight" not in names and "model.model.embed_tokens.weight" in names
    tied = SeparateCritic(LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True)))
    assert tied.model.lm_head.weight.requires_grad


def test_separate_critic_follows_fp32_master_weights(default_model_dir, tmp_path):
    """With fp32_master_weights the policy is held in bf16 with fp32 masters; the separate critic does the same
    (bf16 compute, FP32MasterAdamW), and training moves its masters."""
    from trlx_scale.optim.master_weights import FP32MasterAdamW

    trainer = _trainer(default_model_dir, tmp_path, fp32_master_weights=True, optim_preset=None, max_steps=2)
    assert trainer._policy().dtype == torch.bfloat16
    assert {p.dtype for p in trainer.critic.model.parameters()} == {torch.bfloat16}
    optimizer = trainer.critic_training.optimizer
    assert isinstance(optimizer, FP32MasterAdamW)
    before = [m.detach().clone() for m in optimizer.master_params]
    trainer.train()
    assert all(m.dtype == torch.float32 for m in optimizer.master_params)
    assert any(not torch.equal(a, b) for a, b in zip(before, optimizer.master_params, strict=True))


def test_logs_the_model_states_each_role_holds(default_model_dir, tmp_path):
    """memory/held/<role>_gib (planning/held_memory.py), 1 process, fp32 full fine-tuning after a step: each trainable
    parameter holds 4 B of weight and 8 B of Adam moments (its gradient freed), a frozen one 4 B; the reference holds
    its weights. Checked against that arithmetic, counted from the modules here."""
    trainer = _trainer(default_model_dir, tmp_path, peft=False, max_steps=1, logging_steps=1)
    trainer.train()

    def expected_gib(module) -> float:
        params = {id(p): p for p in module.parameters()}.values()  # tied weights once
        trainable = sum(p.numel() for p in params if p.requires_grad)
        frozen = sum(p.numel() for p in params if not p.requires_grad)
        return (12 * trainable + 4 * frozen) / 2**30

    held = {role: logged(trainer, f"memory/held/{role}_gib")[-1] for role in ("policy", "critic", "reference")}
    assert held["policy"] == pytest.approx(expected_gib(trainer.model), rel=1e-3)
    assert held["critic"] == pytest.approx(expected_gib(trainer.critic), rel=1e-3)
    assert held["reference"] == pytest.approx(expected_gib(trainer.ppo_ref_model), rel=1e-3)
    assert held["critic"] > held["reference"] > 0  # the critic's Adam state is counted, the reference has none


def test_ppo_trains_on_gym_episodes_with_observations_out_of_the_loss(default_model_dir, default_tokenizer, tmp_path):
    """PPOTrainer takes GRPOTrainer's multi-turn rollouts (here rollout_func=GymRollout on the colocated engine): the
    episodes pass the same checks as GRPOTrainer's (helpers/gym_episodes.check_episodes), and the advantages and
    returns are zero exactly on the observations (GAE skips them). With step_reward_credit="own_turn" (and lam=1, no
    KL, no whitening, so that a token's return is the discounted sum of the rewards after it), every token of turn k
    returns the steps' rewards from turn k on, discounted per turn, plus the trajectory's end score brought back
    through the later turns: no turn is credited with an earlier step's reward."""
    from datasets import Dataset

    from trlx_scale.agents.gym_rollout import GymRollout

    from .helpers.gym_episodes import COLOCATED, DISCOUNT, ROWS, AskAgain, check_episodes, count_messages

    class Recording(PPOTrainer):
        def _generate(self, prompts):
            self.generation = super()._generate(prompts)
            return self.generation

        def _calculate_rewards(self, inputs, *args):
            self.scored = (list(inputs), super()._calculate_rewards(inputs, *args))
            return self.scored[1]

        def _finish_rollout(self, batch):
            self.batch = super()._finish_rollout(batch)
            return self.batch

    trainer = Recording(
        model=default_model_dir,
        reward_funcs=count_messages,
        args=_args(
            tmp_path,
            max_steps=1,
            step_reward_credit="own_turn",
            lam=1.0,
            kl_coef=0.0,
            adaptive_kl=False,
            whiten_advantages=False,
            **COLOCATED,
        ),
        train_dataset=Dataset.from_list(ROWS),
        processing_class=default_tokenizer,
        peft_config=LORA,
        rollout_func=GymRollout(AskAgain, turn_reward_discount=DISCOUNT),
    )
    trainer.train()
    inputs, rewards = trainer.scored
    assert check_episodes(default_tokenizer, inputs, trainer.generation, rewards) >= 4
    batch = trainer.batch
    tool_mask = batch.extras["tool_mask"].bool() & batch.completion_mask.bool()
    observations = batch.completion_mask.bool() & ~batch.extras["tool_mask"].bool()
    assert observations.any()
    assert (batch.advantages[observations] == 0).all() and (batch.returns[observations] == 0).all()
    several_turns = 0
    for row, (scored, columns) in enumerate(zip(inputs, rewards.tolist(), strict=True)):
        ends = turn_ends(batch.loss_mask[row : row + 1])[0]
        steps = [r or 0.0 for r in scored["turn_rewards"]] + [0.0] * len(ends)
        end_score = columns[0] + columns[2]  # count_messages and get_reward; the turns column is placed per step
        start = 0
        for k, end in enumerate(ends):
            later = sum(DISCOUNT ** (j - k) * steps[j] for j in range(k, len(ends)))
            expected = later + DISCOUNT ** (len(ends) - 1 - k) * end_score
            turn = tool_mask[row, start : end + 1]
            assert batch.returns[row, start : end + 1][turn].tolist() == pytest.approx([expected] * int(turn.sum()))
            start = end + 1
        several_turns += len(ends) > 1
    assert several_turns >= 2
    assert math.isfinite(logged(trainer, "loss")[0]) and logged(trainer, "ppo/value_loss")


def test_ppo_runs_tool_calls_through_the_concurrent_loop(default_model_dir, default_tokenizer, tmp_path):
    """PPOTrainer with TRL's tools=[fn]: every turn of the untrained model is a call (structured outputs), the tool
    results are out of the loss mask, and GAE gives them no advantage while the sampled tokens around them get one."""
    from trlx_scale.tasks.tool_chat_template import with_tool_template

    from .helpers.inc_tool_calls import EVERY_TURN_CALLS_INC, inc, inc_dataset, length_reward

    class Recording(PPOTrainer):
        def _finish_rollout(self, batch):
            self.batch = super()._finish_rollout(batch)
            return self.batch

    trainer = Recording(
        model=default_model_dir,
        reward_funcs=length_reward,
        args=_args(tmp_path, **EVERY_TURN_CALLS_INC),
        train_dataset=inc_dataset(2),
        processing_class=with_tool_template(default_tokenizer),
        peft_config=LORA,
        tools=[inc],
    )
    trainer.train()
    assert logged(trainer, "tools/calls")[0] > 0
    batch = trainer.batch
    sampled = batch.extras["tool_mask"].bool() & batch.completion_mask.bool()
    tool_tokens = batch.completion_mask.bool() & ~batch.extras["tool_mask"].bool()
    assert tool_tokens.any()
    assert (batch.advantages[tool_tokens] == 0).all() and (batch.returns[sampled] != 0).all()
