"""DPOTrainer: drop-in contract with TRL, reference-free LoRA, vLLM reference log-probs, online DPO, pair building."""

import math

import pytest
import torch
import trl
from peft import LoraConfig

from trlx_scale import DPOConfig, DPOTrainer
from trlx_scale.dpo.preference_pairs import best_worst_pairs, completion_logprob_sums
from trlx_scale.tasks import addition_dataset, addition_preference_dataset, exact_match_reward

from .helpers.trainers import small_dpo_config


def _args(config_cls, output_dir, **overrides):
    return small_dpo_config(output_dir, config_cls, **overrides)


def test_addition_preference_data_prefers_the_correct_answer():
    data = addition_preference_dataset("train", size=50)
    prompts = addition_dataset("train", size=50)
    assert data["prompt"] == prompts["prompt"]
    for row, answer in zip(data, prompts["answer"], strict=True):
        assert row["chosen"][0]["content"] == answer
        assert row["rejected"][0]["content"] != answer and int(row["rejected"][0]["content"]) >= 0


def test_identical_to_trl_when_no_option_is_on(default_model_dir, tmp_path):
    """Same seed, same data: bit-identical losses and weights to trl.DPOTrainer after 2 steps, with padded rows (the
    default, padding-free packed rows, gives the same loss up to float rounding: tests/test_packing.py)."""
    results = []
    for trainer_cls, config_cls in ((trl.DPOTrainer, trl.DPOConfig), (DPOTrainer, DPOConfig)):
        padding = {"padding_free": False} if config_cls is DPOConfig else {}
        trainer = trainer_cls(
            model=default_model_dir,
            args=_args(config_cls, tmp_path / trainer_cls.__module__, **padding),
            train_dataset=addition_preference_dataset("train", size=32),
        )
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        results.append((losses, {k: v.clone() for k, v in trainer.model.state_dict().items()}))
    (trl_losses, trl_weights), (our_losses, our_weights) = results
    assert trl_losses == our_losses and len(our_losses) == 2
    assert all(torch.equal(trl_weights[k], our_weights[k]) for k in trl_weights)
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(default_model_dir).state_dict()
    assert any(not torch.equal(initial[k], our_weights[k]) for k in initial)  # training changed the weights


def test_lora_reference_is_the_base_with_the_adapter_disabled(default_model_dir, tmp_path):
    """No second model: one copy of every base weight in memory, and the reference log-probs equal the base model's
    while the adapter (made non-zero here) changes the policy's."""
    trainer = DPOTrainer(
        model=default_model_dir,
        args=_args(DPOConfig, tmp_path),
        train_dataset=addition_preference_dataset("train", size=16),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    assert trainer.ref_model is None
    base_params = [p for n, p in trainer.model.named_parameters() if "lora_" not in n]
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(default_model_dir)
    assert len({p.data_ptr() for p in base_params}) == sum(1 for _ in plain.parameters())
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    ref_chosen, ref_rejected = trainer.compute_ref_log_probs(trainer.model, batch)
    base = trl.DPOTrainer(
        model=default_model_dir,
        args=_args(trl.DPOConfig, tmp_path / "base"),
        train_dataset=addition_preference_dataset("train", size=16),
    )
    base_chosen, base_rejected = base.compute_ref_log_probs(base.model, batch)
    torch.testing.assert_close(ref_chosen, base_chosen, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_rejected, base_rejected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the policy itself differs from the reference (the adapter is on outside the context)
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        policy = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels)
        assert policy.logits is not None
        policy_logps = trainer.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels, fused_lm_head=True
        ).log_probs.sum(dim=1)
    assert (policy_logps[:4] - ref_chosen).abs().max() > 1e-3


def test_vllm_reference_log_probs_match_the_hf_reference(default_model_dir, tmp_path):
    """Tolerance: 1e-3 nats per sequence with an fp32 engine (measured: ~1e-5); a bf16 engine is not compared."""
    data = addition_preference_dataset("train", size=48)
    trainer = DPOTrainer(
        model=default_model_dir,
        args=_args(DPOConfig, tmp_path, vllm_ref_log_probs=True, vllm_dtype="float32"),
        train_dataset=data,
    )
    assert trainer.args.precompute_ref_log_probs and trainer.ref_model is None
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    batch = trainer.data_collator(rows)
    hf_chosen, hf_rejected = trainer.compute_ref_log_probs(trainer.model, batch)
    vllm_chosen = torch.tensor([row["ref_chosen_logps"] for row in rows], dtype=hf_chosen.dtype)
    vllm_rejected = torch.tensor([row["ref_rejected_logps"] for row in rows], dtype=hf_rejected.dtype)
    torch.testing.assert_close(vllm_chosen, hf_chosen, rtol=0, atol=1e-3)
    torch.testing.assert_close(vllm_rejected, hf_rejected, rtol=0, atol=1e-3)
    assert (hf_chosen - hf_rejected).abs().max() > 1.0  # chosen and rejected really differ: not trivially equal
    trainer.train()  # trains on the precomputed columns
    assert math.isclose(trainer.state.log_history[0]["loss"], math.log(2), rel_tol=1e-3)  # policy == reference


def test_vllm_reference_of_a_lora_policy_is_its_base(default_model_dir, tmp_path):
    """LoRA policy: the engine scores the base (merged fresh adapter), equal to TRL's adapter-disabled reference."""
    trainer = DPOTrainer(
        model=default_model_dir,
        args=_args(DPOConfig, tmp_path, vllm_ref_log_probs=True, vllm_dtype="float32"),
        train_dataset=addition_preference_dataset("train", size=16),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    hf_chosen, _ = trainer.compute_ref_log_probs(trainer.model, trainer.data_collator(rows))
    vllm_chosen = torch.tensor([row["ref_chosen_logps"] for row in rows], dtype=hf_chosen.dtype)
    torch.testing.assert_close(vllm_chosen, hf_chosen, rtol=0, atol=1e-3)


def test_completion_logprob_sums_counts_exactly_the_completion_tokens():
    class FakeScorer:
        def sequence_logprobs(self, sequences, use_adapter=False):
            # log-prob of token t := -t (position), so sums are easy to write by hand.
            return [[-float(t) for t in range(1, len(s))] for s in sequences]

    input_ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 9, 0, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    completion_mask = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 0, 0]])
    assert completion_logprob_sums(FakeScorer(), input_ids, attention_mask, completion_mask) == [-5.0, -2.0]


def test_best_worst_pairs_skip_ties_and_abstentions():
    prompts = [[1], [2], [3]]
    completions = [[10], [11], [12], [20], [21], [22], [30], [31], [32]]
    rewards = torch.tensor([[0.0, 1.0, 0.5], [1.0, 1.0, 1.0], [float("nan"), 0.0, 2.0]])
    pairs, stats = best_worst_pairs(prompts, completions, rewards)
    assert pairs == [
        {"prompt_ids": [1], "chosen_ids": [11], "rejected_ids": [10]},
        {"prompt_ids": [3], "chosen_ids": [32], "rejected_ids": [31]},
    ]
    assert stats["pair_fraction"] == pytest.approx(2 / 3) and stats["reward_gap"] == pytest.approx(1.5)


class _AwaitedExactMatch:
    """An async reward function with TRL's arguments (GRPO's scorer runs online DPO's rewards too)."""

    __name__ = "awaited_exact_match"

    def __init__(self):
        self.states = []

    async def __call__(self, completions, answer, trainer_state, log_metric, log_extra, **kwargs):
        self.states.append(trainer_state)
        log_metric("online_check/calls", 1.0)
        log_extra("online_check_note", ["ok"] * len(completions))  # no completions table in DPO: dropped
        return exact_match_reward(completions=completions, answer=answer)


def _zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_online_round_builds_valid_pairs_from_the_policy_and_trains(default_model_dir, tmp_path):
    """Also: the rewards come from GRPO's scorer with TRL's arguments, an async function awaited beside a
    synchronous one (their sum ranks the samples)."""
    from transformers import TrainerState

    awaited = _AwaitedExactMatch()
    args = _args(
        DPOConfig,
        tmp_path,
        online=True,
        online_num_generations=8,
        online_max_completion_length=6,
        vllm_dtype="float32",
        vllm_sync_mode="lora",  # "auto" merges on CPU engines; the LoRA-only path is what this test covers
        max_steps=2,
        learning_rate=5e-4,
    )
    trainer = DPOTrainer(
        model=default_model_dir,
        args=args,
        train_dataset=addition_dataset("train", size=64),
        reward_funcs=[awaited, _zero_reward],
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    # The trainer works on its own copy of the config: the caller's keeps remove_unused_columns as given.
    assert args.remove_unused_columns and not trainer.args.remove_unused_columns
    examples = [trainer.train_dataset[i] for i in range(8)]
    pairs = trainer.online.round(examples)
    assert pairs, "the pre-trained model answers some prompts right and some wrong"
    tokenizer = trainer.processing_class
    by_prompt = {tuple(e["prompt_ids"]): e["answer"] for e in examples}
    for pair in pairs:
        answer = by_prompt[tuple(pair["prompt_ids"])]
        assert tokenizer.decode(pair["chosen_ids"], skip_special_tokens=True).strip() == answer
        assert tokenizer.decode(pair["rejected_ids"], skip_special_tokens=True).strip() != answer
    assert trainer._engine.sync_mode == "lora"
    trainer.train()
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"online/reward_mean", "online/pair_fraction", "sync/bytes", "online_check/calls"} <= logged
    assert awaited.states and all(isinstance(state, TrainerState) for state in awaited.states)
    # The profiler's phases of an online round (trlx_scale.profiling): sampling, its sync, the rewards, the loss.
    assert {"time/generation", "time/weight_sync", "time/reward", "time/loss_forward_backward"} <= logged
    assert {"throughput/generated_tokens_per_s", "perf/mfu"} <= logged
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


class _SmallestTokenSumPreferred(DPOTrainer):
    """A subclass that ranks by the collector's reward seam: the completion whose token ids sum lowest wins."""

    def _rollout_rewards(self, rows, prompts, samples):
        super()._rollout_rewards(rows, prompts, samples)  # the scorer still runs (and gathers)
        sums = torch.tensor([float(sum(ids)) for ids in samples.completion_ids])
        return -self.accelerator.gather(sums)[:, None]


def test_online_rounds_sample_and_score_through_the_rollout_collector(default_model_dir, tmp_path):
    """Online DPO's samples and rewards are the rollout collector's stages (``sample_and_score``): the samples carry
    the engine's log-probs of every sampled token and the policy version, and a subclass's ``_rollout_rewards`` (the
    seam GRPOTrainer has too) decides the pairs."""
    from trlx_scale.rollout.collector import RolloutCollector

    args = _args(
        DPOConfig,
        tmp_path,
        online=True,
        online_num_generations=4,
        online_max_completion_length=8,
        online_temperature=1.5,  # different completions in a group
        vllm_dtype="float32",
        max_steps=1,
    )
    trainer = _SmallestTokenSumPreferred(
        model=default_model_dir,
        args=args,
        train_dataset=addition_dataset("train", size=16),
        reward_funcs=[exact_match_reward],
    )
    examples = [trainer.train_dataset[i] for i in range(8)]
    rows = [dict(example) for example in examples for _ in range(4)]
    scored = RolloutCollector(trainer).sample_and_score(rows, trainer.policy_version)
    # This process's rows of the gathered rewards are its own samples' (the subclass's reward: minus the token sum).
    expected = [-float(sum(ids)) for ids in scored.samples.completion_ids]
    assert scored.local_rewards_per_func[:, 0].tolist() == expected
    for ids, logps in zip(scored.samples.completion_ids, scored.samples.sampling_logps, strict=True):
        assert len(logps) == len(ids) and all(math.isfinite(x) and x <= 0 for x in logps)
    pairs = trainer.online.round(examples)
    assert pairs, "at temperature 1.5 some group has different completions"
    for pair in pairs:
        assert sum(pair["chosen_ids"]) < sum(pair["rejected_ids"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"online": True, "online_num_generations": 1}, "online_num_generations must be at least 2"),
        ({"online": True, "vllm_ref_log_probs": True}, "set vllm_ref_log_probs=False"),
        ({"vllm_dtype": "fp8"}, "vllm_dtype must be one of"),
    ],
)
def test_bad_settings_are_refused_with_the_fix(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _args(DPOConfig, tmp_path, **overrides)


def test_online_needs_reward_functions_and_reward_functions_need_online(default_model_dir, tmp_path):
    with pytest.raises(ValueError, match="pass reward_funcs"):
        DPOTrainer(
            model=default_model_dir,
            args=_args(DPOConfig, tmp_path, online=True),
            train_dataset=addition_dataset("train", size=8),
        )
    with pytest.raises(ValueError, match="set online=True"):
        DPOTrainer(
            model=default_model_dir,
            args=_args(DPOConfig, tmp_path),
            train_dataset=addition_preference_dataset("train", size=8),
            reward_funcs=exact_match_reward,
        )
