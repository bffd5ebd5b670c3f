"""``recompute_forwards``: packed forwards recomputed in the backward instead of kept (passes.forward_recompute).

Two claims are checked: the gradient is the one without the recompute (the recompute runs the same forward on the
same inputs: bit for bit on this CPU, so the tolerance is 0 for the log-probs and float rounding of the summed
gradient for the gradients), and the graph keeps only the forwards' inputs and per-token outputs, not their
activations (counted with saved-tensor hooks: what autograd keeps for the backward, independent of the allocator).
The trainers' runs with and without it train alike (GRPO, PPO's critic, DPO); under 2 DDP processes the packed run
of tests/test_packing_distributed.py recomputes (its budget cuts the loss pass) and equals the padded run; under FSDP2
(2 processes, raw fully_shard) the pass gives the kept forwards' gradient with the ranks' forward counts differing.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from trlx_scale import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from trlx_scale.passes import PackedPass, PassRequest
from trlx_scale.passes.forward_recompute import run_forward
from trlx_scale.passes.prefix_tree import PrefixTreePass
from trlx_scale.tasks import addition_dataset, exact_match_reward

from .helpers.launch import run_torchrun_report
from .helpers.trainers import logged, small_grpo_config

PROMPT, COMPLETION = 9, 7


def _batch(rows=8, seed=0):
    """Left-padded prompts and right-padded completions of mixed lengths, two rows per prompt (a group)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 250, (rows, PROMPT + COMPLETION), generator=generator)
    ids[1::2, :PROMPT] = ids[0::2, :PROMPT]
    mask = torch.ones_like(ids)
    for i in range(rows):
        mask[i, : PROMPT - (2, 9, 5, 4)[(i // 2) % 4]] = 0
        mask[i, PROMPT + (7, 1, 4, 6, 2)[i % 5] :] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _model(default_model_dir, checkpointing=None):
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
        model.enable_input_require_grads()  # what PEFT does, and what reentrant checkpointing needs
    model.train()
    return model


def _pass(kind, recompute):
    layout = dict(agree_max=lambda n: n, autocast=contextlib.nullcontext, max_tokens=12, recompute=recompute)
    packed = PackedPass(None, **layout)
    return packed if kind == "packed" else PrefixTreePass(packed, **layout)


def _kept_bytes(model):
    """Counts the bytes of the non-parameter tensors autograd saves for the backward while it is active."""
    parameters = {p.data_ptr() for p in model.parameters()}
    kept = {"bytes": 0}

    def pack(tensor):
        if tensor.data_ptr() not in parameters:
            kept["bytes"] += tensor.numel() * tensor.element_size()
        return tensor

    return kept, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def _run(model, kind, recompute):
    ids, mask = _batch()
    model.zero_grad()
    kept, hooks = _kept_bytes(model)
    with hooks:
        result = _pass(kind, recompute).run(model, PassRequest(ids, mask, COMPLETION, compute_entropy=True))
    weights = torch.linspace(-1, 1, ids.size(0))[:, None]
    ((result.logps * weights + 0.1 * result.entropies) * mask[:, -COMPLETION:]).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return result, grads, kept["bytes"]


@pytest.mark.parametrize("kind", ["packed", "prefix_tree"])
@pytest.mark.parametrize("checkpointing", [None, False, True], ids=["no_checkpointing", "non_reentrant", "reentrant"])
def test_recomputed_forwards_give_the_same_gradient_and_keep_no_activations(default_model_dir, kind, checkpointing):
    model = _model(default_model_dir, checkpointing)
    kept_result, kept_grads, kept_bytes = _run(model, kind, recompute=False)
    result, grads, recomputed_bytes = _run(model, kind, recompute=True)
    assert result.forwards > 1 and result.recomputed_forwards == result.forwards
    assert kept_result.recomputed_forwards == 0
    torch.testing.assert_close(result.logps, kept_result.logps, rtol=0, atol=0)
    torch.testing.assert_close(result.entropies, kept_result.entropies, rtol=0, atol=0)
    assert grads.keys() == kept_grads.keys() and grads
    for name, grad in kept_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-7 * float(grad.abs().max()), msg=name)
    # Kept for the backward: the forwards' inputs and outputs and the gathering onto the grid (a few KiB), against
    # every forward's activations (or, under layer checkpointing, every layer's input) without the recompute.
    assert recomputed_bytes * 4 < kept_bytes, (recomputed_bytes, kept_bytes)


@pytest.mark.distributed
def test_recomputed_forwards_under_fsdp2_give_the_kept_gradient(tmp_path):
    """FSDP2 (raw fully_shard on gloo, 2 processes), full fine-tuning and LoRA, with and without layer
    checkpointing: rank 0 packs its rows into more forwards than rank 1, which runs lockstep dummies (recomputed
    too, so the ranks' all-gathers match in the backward); log-probs equal and full gradients within 1e-6 of their
    norm (tests/distributed/forward_recompute_fsdp2.py)."""
    report = run_torchrun_report("forward_recompute_fsdp2.py", tmp_path / "fsdp2.json", port=29671)
    assert sorted(report) == ["full", "full_checkpointing", "lora", "lora_checkpointing"]
    for name, result in report.items():
        ranks = result["counts"]
        assert ranks[0]["forwards"] > ranks[1]["forwards"] > 1, name  # the dummies run
        assert [r["recomputed"] for r in ranks] == [r["forwards"] for r in ranks], name
        assert [r["kept"] for r in ranks] == [0, 0], name
        assert result["grad_norm"] > 1.0, name  # real gradients are compared
        assert result["max_logp_difference"] == 0.0, name
        assert result["max_grad_difference"] < 1e-6 * result["grad_norm"], name


def test_a_single_forward_or_a_pass_without_gradients_is_not_recomputed(default_model_dir):
    model = _model(default_model_dir)
    ids, mask = _batch()
    whole = PackedPass(None, agree_max=lambda n: n, autocast=contextlib.nullcontext, max_tokens=None, recompute=True)
    assert whole.run(model, PassRequest(ids, mask, COMPLETION)).recomputed_forwards == 0  # one forward
    with torch.no_grad():
        assert _pass("packed", True).run(model, PassRequest(ids, mask, COMPLETION)).recomputed_forwards == 0


# ---------------------------------------------------------------- the trainers


def _train(model, tmp_path, recompute, trainer_cls=GRPOTrainer, config_cls=GRPOConfig, peft_config=None, **overrides):
    values = dict(max_completion_length=10, max_steps=2, seed=5, padding_free=True, max_tokens_per_microbatch=40)
    values.update(overrides, recompute_forwards=recompute)
    trainer = trainer_cls(
        model=model,
        reward_funcs=exact_match_reward,
        args=small_grpo_config(tmp_path / f"{trainer_cls.__name__}-{recompute}", config_cls, **values),
        train_dataset=addition_dataset("train", size=48),
        peft_config=peft_config,
    )
    trainer.train()
    return trainer


def test_grpo_trains_alike_and_auto_recomputes_under_a_budget(tmp_path, default_model_dir):
    kept = _train(default_model_dir, tmp_path, "false")
    auto = _train(default_model_dir, tmp_path, "auto")
    assert logged(auto, "reward") == logged(kept, "reward")
    assert min(logged(auto, "batch/recomputed_forwards")) > 1 and max(logged(kept, "batch/recomputed_forwards")) == 0
    torch.testing.assert_close(logged(auto, "loss"), logged(kept, "loss"), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(logged(auto, "grad_norm"), logged(kept, "grad_norm"), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("critic_mode", ["separate", "shared_base"])
def test_ppo_critic_trains_alike_with_recomputed_forwards(tmp_path, default_model_dir, monkeypatch, critic_mode):
    """The critic's packed forwards are recomputed too (counted where PPO calls run_forward: the policy's are in
    batch/recomputed_forwards). shared_base switches to the critic's adapter inside the forward, so the recompute,
    run during the backward, switches again: the values and the gradients are the kept run's."""
    import trlx_scale.ppo.rollout_advantages as ppo_module  # where PPO's critic forwards run

    calls = {"recomputed": 0}

    def counting_run_forward(forward, *tensors, recompute):
        calls["recomputed"] += int(recompute and torch.is_grad_enabled())
        return run_forward(forward, *tensors, recompute=recompute)

    monkeypatch.setattr(ppo_module, "run_forward", counting_run_forward)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    runs, critic_recomputes = {}, {}
    for setting in ("false", "auto"):
        calls["recomputed"] = 0
        runs[setting] = _train(
            default_model_dir,
            tmp_path / critic_mode,
            setting,
            PPOTrainer,
            PPOConfig,
            critic_learning_rate=1e-3,
            critic_mode=critic_mode,
            peft_config=lora,
        )
        critic_recomputes[setting] = calls["recomputed"]
    assert critic_recomputes == {"false": 0, "auto": critic_recomputes["auto"]} and critic_recomputes["auto"] > 2
    assert min(logged(runs["auto"], "batch/recomputed_forwards")) > 1
    for key in ("loss", "ppo/value_loss", "ppo/values_mean", "grad_norm"):
        torch.testing.assert_close(
            logged(runs["auto"], key), logged(runs["false"], key), rtol=1e-5, atol=1e-7, msg=key
        )


def test_dpo_policy_forward_trains_alike_with_recomputed_forwards(tmp_path, default_model_dir):
    from trlx_scale import DPOConfig, DPOTrainer
    from trlx_scale.tasks import addition_preference_dataset

    from .helpers.trainers import small_dpo_config

    runs = {}
    for setting in ("false", "auto"):
        args = small_dpo_config(
            tmp_path / f"dpo-{setting}",
            DPOConfig,
            padding_free=True,
            max_tokens_per_microbatch=24,
            recompute_forwards=setting,
            max_steps=2,
        )
        trainer = DPOTrainer(
            model=default_model_dir,
            args=args,
            train_dataset=addition_preference_dataset("train", size=16),
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
        )
        trainer.train()
        runs[setting] = trainer
    assert min(logged(runs["auto"], "batch/recomputed_forwards")) > 1
    assert max(logged(runs["false"], "batch/recomputed_forwards")) == 0
    for key in ("loss", "grad_norm", "logps/chosen", "rewards/margins"):
        torch.testing.assert_close(logged(runs["auto"], key), logged(runs["false"], key), rtol=1e-6, atol=1e-7)


def test_bad_settings_name_the_field(tmp_path, default_model_dir):
    with pytest.raises(ValueError, match="recompute_forwards must be one of"):
        small_grpo_config(tmp_path, recompute_forwards="sometimes")
    with pytest.raises(ValueError, match="recompute_forwards='true' recomputes packed forwards, and padding_free="):
        small_grpo_config(tmp_path, recompute_forwards="true", padding_free=False, max_tokens_per_microbatch=40)
    with pytest.raises(ValueError, match="recompute_forwards='true' needs max_tokens_per_microbatch"):
        small_grpo_config(tmp_path, recompute_forwards="true")
    # padding_free='auto' turned off by the model (flex_attention has no backward on CPU): an error at the first pass.
    with pytest.raises(ValueError, match="recompute_forwards='true' recomputes packed forwards, and the passes are"):
        _train(
            default_model_dir,
            tmp_path,
            "true",
            padding_free=None,
            model_init_kwargs={"attn_implementation": "flex_attention"},
        )


def _layout(deepspeed_stage=None, fsdp=False, **fields):
    """PassLayout's decision on a stand-in trainer: the config fields and the layout flags it reads."""
    from types import SimpleNamespace

    from trlx_scale.passes.padding_free_choice import PassLayout

    class StandIn:  # weakly referenced by the component, as a trainer is
        pass

    trainer = StandIn()
    trainer.args = SimpleNamespace(**fields)
    trainer.is_deepspeed_enabled, trainer.is_fsdp_enabled = deepspeed_stage is not None, fsdp
    plugin = SimpleNamespace(zero_stage=deepspeed_stage)
    trainer.accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))
    trainer.pass_layout = PassLayout(trainer)
    return trainer


def _recomputes(**settings) -> bool:
    trainer = _layout(**settings)  # held here: the layout holds its trainer weakly
    return trainer.pass_layout.recompute_forwards()


def test_zero3_refuses_it_by_name_and_the_other_layouts_take_it():
    budget = dict(max_tokens_per_microbatch=64)
    assert _recomputes(deepspeed_stage=2, recompute_forwards="auto", **budget)
    assert not _recomputes(recompute_forwards="auto", max_tokens_per_microbatch=None)
    assert not _recomputes(deepspeed_stage=3, recompute_forwards="auto", **budget)
    assert _recomputes(fsdp=True, recompute_forwards="auto", **budget)  # FSDP2: verified
    with pytest.raises(ValueError, match="recompute_forwards='true' cannot run: under DeepSpeed ZeRO-3"):
        _recomputes(deepspeed_stage=3, recompute_forwards="true", **budget)


def test_trls_zero3_gather_in_the_fused_head_still_reads_deepspeeds_attribute():
    """Why ZeRO-3 is refused: TRL's fused LM head backward asks each saved weight for DeepSpeed's ``ds_status``,
    which a recomputed forward's saved tensors lack (a 2-process ZeRO-3 run with it failed on that AttributeError).
    When this fails, TRL gathers differently: rerun that run (tests/test_packing_distributed.py's ZeRO-3 command
    with --use_peft false --recompute_forwards true) and lift the refusal if it trains."""
    import inspect

    from trl.trainer import utils as trl_utils

    assert "ds_status" in inspect.getsource(trl_utils.maybe_gather_lm_head_ctx)
