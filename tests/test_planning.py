"""The memory planner's formulas against hand counts, the recommendation, the GPU split, and its bad-input errors."""

import math
from dataclasses import replace

import pytest

from trlx_scale.planning import Layout, ModelShape, RunSpec, balance, plan, resolve_accelerator, role_memory
from trlx_scale.planning.memory_model import (
    GIB,
    activation_bytes,
    gathered_working_set,
    training_state,
)
from trlx_scale.planning.resource_split import continuous_optimum

from .helpers.models import tiny_llama_config

# A small GQA model: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, MLP 128, vocabulary 100, untied head.
TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=100, intermediate=128)


def test_parameter_count_by_hand():
    """attention: q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12288; MLP: 3 x 64 x 128 = 24576; norms 2 x 64;
    per layer 36992; 2 layers 73984; embeddings 100 x 64 x 2 (untied) = 12800; final norm 64: 86848."""
    shape = ModelShape(**TINY)
    assert shape.attention_params_per_layer == 12288
    assert shape.layer_params == 36992
    assert shape.total_params == 86848


def test_exact_count_from_a_transformers_config_matches_the_hand_count():
    config = tiny_llama_config()
    shape = ModelShape.from_config(config)
    assert shape.total_params == ModelShape(**TINY).total_params == 86848
    assert (shape.layers, shape.hidden, shape.kv, shape.dim, shape.intermediate) == (2, 64, 2, 16, 128)


def test_llama_2_7b_shape_gives_its_published_parameter_count():
    shape = ModelShape(layers=32, hidden=4096, heads=32, vocab=32000, intermediate=11008)
    assert shape.total_params == 6_738_415_616  # Llama-2-7b-hf's safetensors hold exactly this many
    # Given only the total, the MLP width is recovered from it.
    derived = ModelShape(params=6_738_415_616, layers=32, hidden=4096, heads=32, vocab=32000).complete()
    assert abs(derived.intermediate - 11008) <= 1


def test_lora_parameters_by_hand():
    """r=8 on q (64->64), k (64->32), v (64->32), o (64->64), gate/up (64->128), down (128->64):
    8 x (128 + 96 + 96 + 128 + 192 + 192 + 192) = 8 x 1024 = 8192 per layer, 16384 for 2 layers."""
    assert ModelShape(**TINY).lora_params(8) == 16384
    assert ModelShape(**TINY).lora_params(8, ("q_proj", "v_proj")) == 2 * 8 * (128 + 96)
    with pytest.raises(ValueError, match="--lora-targets"):
        ModelShape(**TINY).lora_params(8, ("qkv",))


def test_kv_cache_bytes_per_token_by_hand():
    # 2 (K, V) x 2 layers x 2 KV heads x 16 dims x 2 bytes = 256
    assert ModelShape(**TINY).kv_bytes_per_token(2) == 256


@pytest.mark.parametrize(
    ("backend", "offload", "gpu_bytes", "host_bytes"),
    [
        ("ddp", False, 16, 0),  # 2 + 2 + 4 + 8, replicated
        ("zero2", False, 2 + (2 + 12) / 4, 0),  # gradients and optimizer sharded by 4
        ("zero3", False, 16 / 4, 0),  # all sharded by 4
        ("fsdp2", False, 16 / 4, 0),  # fp32 sharded params are the masters: 4 + 4 + 8, by 4
        ("zero3", True, 4 / 4, 12 / 4),  # optimizer (masters + moments) on the host
        ("fsdp2", True, 0, 16 / 4),  # everything on the host
    ],
)
def test_training_state_bytes_per_parameter(backend, offload, gpu_bytes, host_bytes):
    parts = training_state(1000, "bf16-master", backend, offload, gpus=4)
    assert sum(gpu for gpu, _ in parts.values()) == pytest.approx(1000 * gpu_bytes)
    assert sum(host for _, host in parts.values()) == pytest.approx(1000 * host_bytes)


def test_fp32_under_deepspeed_counts_its_fp32_partition_copy():
    # fp32 model: 4 (weights) + 4 (gradients) + 8 (moments), plus DeepSpeed's fp32 flat copy of the partition.
    assert sum(g for g, _ in training_state(1000, "fp32", "ddp", False, 2).values()) == 16000
    assert sum(g for g, _ in training_state(1000, "fp32", "zero3", False, 2).values()) == 20000 / 2


def test_activation_formula_by_hand():
    """Per layer and token: 4h + 2ad + 2kd + 4f = 256 + 128 + 64 + 512 = 960 values.
    2 sequences x 10 tokens x 2 layers x 960 x 2 bytes = 76800; logits: 2 x 4 scored x 100 x (2 + 8) = 8000."""
    shape = ModelShape(**TINY)
    assert activation_bytes(shape, 2, 10, 4, 2, checkpointing=False) == 76800 + 8000
    # Checkpointing: layer inputs (2 layers x 20 tokens x 64) + one layer recomputed (20 x 960), x 2 bytes.
    assert activation_bytes(shape, 2, 10, 4, 2, checkpointing=True) == (2 * 20 * 64 + 20 * 960) * 2 + 8000


def test_a_token_budget_bounds_the_recomputed_layer_only():
    """Packed passes under max_tokens_per_microbatch: 4 sequences x 10 tokens in forwards of at most 12 tokens. With
    checkpointing the backward recomputes one layer of one forward (12 tokens, not 40); the kept layer inputs and the
    logits are the micro-batch's (TRL's loss spans it). A budget below the longest sample: that sample's forward.
    Without checkpointing every forward's graph is kept: the budget changes nothing."""
    shape = ModelShape(**TINY)
    kept, logits = 2 * 40 * 64, 4 * 4 * 100 * (2 + 8)
    assert activation_bytes(shape, 4, 10, 4, 2, True, max_tokens_per_microbatch=12) == (kept + 12 * 960) * 2 + logits
    assert activation_bytes(shape, 4, 10, 4, 2, True, max_tokens_per_microbatch=4) == (kept + 10 * 960) * 2 + logits
    assert activation_bytes(shape, 4, 10, 4, 2, True, max_tokens_per_microbatch=400) == (kept + 40 * 960) * 2 + logits
    unbounded = activation_bytes(shape, 4, 10, 4, 2, False)
    assert activation_bytes(shape, 4, 10, 4, 2, False, max_tokens_per_microbatch=12) == unbounded
    run = _run(micro_batch=8, max_tokens_per_microbatch=12, recompute_forwards="false")
    roles = {r.role: r for r in role_memory(run, Layout(), 80).roles}
    full = {r.role: r for r in role_memory(_run(micro_batch=8), Layout(), 80).roles}
    assert full["activations"].training - roles["activations"].training == (80 - 12) * 960 * 2
    assert "one layer of 12 tokens recomputed" in roles["activations"].formula


def test_recomputed_forwards_bound_the_activations_and_logits_by_the_budget():
    """recompute_forwards: the micro-batch keeps each scored token's log-prob and entropy (8 bytes) and the backward
    holds one forward's graph at a time: 4 sequences x 10 tokens in forwards of 12 tokens hold 12 tokens' layer
    inputs and logits (12/40 of the 16 scored tokens), not 40. 'auto' plans it where the trainer runs it (not under
    ZeRO-3, which refuses it)."""
    shape = ModelShape(**TINY)
    logits = 16 * 12 / 40 * 100 * (2 + 8)
    checkpointed = activation_bytes(shape, 4, 10, 4, 2, True, 12, recompute_forwards=True)
    assert checkpointed == (2 * 12 * 64 + 12 * 960) * 2 + logits + 16 * 8
    assert activation_bytes(shape, 4, 10, 4, 2, False, 12, recompute_forwards=True) == 2 * 12 * 960 * 2 + logits + 128
    # Without a budget there is one forward: nothing is recomputed, whatever the setting.
    assert activation_bytes(shape, 4, 10, 4, 2, True, None, recompute_forwards=True) == activation_bytes(
        shape, 4, 10, 4, 2, True
    )
    run = _run(micro_batch=8, max_tokens_per_microbatch=12)  # recompute_forwards="auto"
    kept = {r.role: r for r in role_memory(replace(run, recompute_forwards="false"), Layout(), 80).roles}
    recomputed = {r.role: r for r in role_memory(run, Layout(), 80).roles}
    assert recomputed["activations"].training < kept["activations"].training
    assert "forwards of 12 tokens recomputed one at a time" in recomputed["activations"].formula
    zero3 = role_memory(replace(run, recompute_forwards="true"), Layout(backend="zero3"), 80)
    assert "one layer of 12 tokens recomputed" in {r.role: r for r in zero3.roles}["activations"].formula
    assert any("refuses it under zero3" in note for note in zero3.notes)


def test_gathered_working_set():
    shape = ModelShape(**TINY)
    # two layers plus the largest tensor (here an MLP matrix, 64 x 128, larger than the 100 x 64 embedding)
    assert gathered_working_set(shape, 2, "fsdp2") == (2 * 36992 + 64 * 128) * 2
    assert gathered_working_set(shape, 2, "zero3") == 86848 * 2  # below stage3_max_live_parameters: all of it
    big = ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, vocab=128256, intermediate=28672)
    assert gathered_working_set(big, 2, "zero3") == 1e9 * 2


def _run(**overrides):
    values = dict(model=ModelShape(**TINY), prompt_length=6, completion_length=4, micro_batch=2)
    values.update(overrides)
    return RunSpec(**values)


def test_roles_sum_to_the_phase_totals_and_the_engine_swaps_with_training():
    run = _run(algo="grpo", vllm_gpu_memory_utilization=0.5, runtime_overhead_gib=0.0)
    result = role_memory(run, Layout("ddp", False, 1, 1), gpu_memory_gib=1.0)
    roles = {r.role: r for r in result.roles}
    engine = roles["vLLM engine (sleep level 2)"]
    assert engine.generation == 0.5 * GIB and engine.training == 0  # asleep while training
    assert roles["policy gradients"].generation == 0 and roles["activations"].generation == 0
    assert result.training_gib * GIB == pytest.approx(sum(r.training for r in result.roles))
    assert result.per_gpu_gib == max(result.training_gib, result.generation_gib)
    assert result.fits and result.headroom_gib == pytest.approx(1.0 - result.per_gpu_gib)


def test_engine_without_sleep_stays_during_training_and_level_1_keeps_weights_on_the_host():
    run = _run(vllm_sleep=False, runtime_overhead_gib=0.0)
    roles = {r.role: r for r in role_memory(run, Layout(), 10.0).roles}
    assert roles["vLLM engine (no sleep)"].training == 3 * GIB
    lora = _run(lora_rank=4, runtime_overhead_gib=0.0)
    engine = {r.role: r for r in role_memory(lora, Layout(), 10.0).roles}["vLLM engine (sleep level 1)"]
    assert engine.host == 86848 * 2  # its bf16 weights wait in host RAM


def test_reference_and_critic_roles():
    ppo = role_memory(_run(algo="ppo", runtime_overhead_gib=0), Layout("zero3", False, 1, 4), 80.0)
    roles = {r.role: r for r in ppo.roles}
    # PPO's full-FT reference is prepared like TRL's: its quarter, plus the parameters a ZeRO-3 forward keeps gathered
    # (all of them below stage3_max_live_parameters).
    assert roles["reference"].training == 86848 * 2 / 4 + 86848 * 2
    critic = roles["critic (separate, sharded)"]  # a DeepSpeed engine of its own, sharded like the policy
    assert critic.training < 86848 * 16 / 2  # far below the fp32 replica's 16 B per parameter
    ddp = {r.role: r for r in role_memory(_run(algo="ppo"), Layout("ddp", False, 1, 4), 80.0).roles}
    assert ddp["critic (separate)"].training == 86848 * 16  # fp32 weights + gradients + fp32 AdamW, replicated
    assert ddp["reference"].training == 86848 * 2
    shared = role_memory(_run(algo="ppo", critic_mode="shared_base", lora_rank=8), Layout(), 80.0)
    assert {r.role for r in shared.roles} >= {"critic (shared base)", "policy base (frozen)"}
    assert "reference" not in {r.role for r in shared.roles}  # a LoRA policy's reference is its base
    grpo = role_memory(_run(algo="grpo"), Layout(), 80.0)
    assert "reference" not in {r.role for r in grpo.roles}  # beta = 0


def test_recommendation_is_the_fewest_gpus_then_no_offload():
    model = ModelShape(layers=32, hidden=4096, heads=32, vocab=32000, intermediate=11008)
    a100 = resolve_accelerator("a100-80", None)
    lora = plan(RunSpec(model, algo="grpo", lora_rank=16), a100, 1, 8)
    assert lora.recommendation.layout.gpus == 1 and not lora.recommendation.layout.offload  # 7B LoRA: one GPU
    full_run = RunSpec(model, algo="grpo")
    without = plan(full_run, a100, 1, 8).recommendation
    assert without is not None and without.fits and without.layout.gpus > 1 and not without.layout.offload
    for backend in ("ddp", "zero2", "fsdp2", "zero3"):  # nothing with fewer GPUs fits without offload
        smaller = Layout(backend, False, 1, without.layout.gpus // 2)
        assert not role_memory(full_run, smaller, a100.memory_gib).fits
    # Allowed to offload, fewer GPUs come first: one GPU with the optimizer on the host (ZeRO-Offload).
    offloaded = plan(full_run, a100, 1, 8, offload=True).recommendation
    assert offloaded.layout.gpus < without.layout.gpus and offloaded.layout.offload


def test_balanced_split_by_hand():
    """G = 1000 tokens at 10/s per GPU, R = 3000 at 10/s: g* = 8 x 100 / (100 + 300) = 2."""
    assert continuous_optimum(8, 1000, 3000, 10, 10) == 2
    split = balance(8, 1000, 3000, 10, 10)
    assert (split.generation_gpus, split.training_gpus) == (2, 6)
    assert split.generation_seconds == 50 and split.training_seconds == 50 and split.idle_fraction == 0
    # With a tensor-parallel size of 4 the engine takes whole groups of 4.
    assert balance(8, 1000, 3000, 10, 10, tensor_parallel_size=4).generation_gpus == 4


@pytest.mark.parametrize(
    ("call", "flag"),
    [
        (lambda: resolve_accelerator("tpu-v9", None), "--gpu-memory-gb"),
        (lambda: resolve_accelerator(None, None), "--gpu"),
        (lambda: plan(_run(vllm_tensor_parallel_size=3), resolve_accelerator("h100", None), 1, 8), "--vllm-tp"),
        (lambda: role_memory(_run(algo="a2c"), Layout(), 80), "--algo"),
        (lambda: role_memory(_run(max_tokens_per_microbatch=0), Layout(), 80), "--max-tokens-per-microbatch"),
        (lambda: role_memory(_run(recompute_forwards="yes"), Layout(), 80), "--recompute-forwards"),
        (lambda: role_memory(_run(), Layout("ddp", True), 80), "--offload"),
        (lambda: role_memory(_run(algo="ppo", critic_mode="shared_base"), Layout(), 80), "--lora-rank"),
        (lambda: ModelShape(params=1e6, layers=32, hidden=4096, heads=32).complete(), "--params"),
        (lambda: ModelShape(layers=2, hidden=64, heads=4, kv_heads=3).complete(), "--kv-heads"),
        (lambda: balance(1, 1, 1, 1, 1), "--gpus-per-node"),
    ],
)
def test_bad_inputs_name_the_flag(call, flag):
    with pytest.raises(ValueError, match=flag):
        call()


def test_model_directory_without_config_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--model .*config.json"):
        ModelShape.from_pretrained(str(tmp_path))


def test_seven_b_ppo_critic_replica_costs_what_the_scale_issue_measured():
    """A separate 7B critic replicated in fp32 with fp32 AdamW (DDP): 16 B x 6.74e9 = 100.4 GiB per GPU (the
    "~112 GB"); under ZeRO-3 on 8 GPUs it is sharded like the policy and the run fits."""
    model = ModelShape(layers=32, hidden=4096, heads=32, vocab=32000, intermediate=11008)
    result = role_memory(RunSpec(model, algo="ppo"), Layout("ddp", False, 1, 8), 80.0)
    critic = {r.role: r for r in result.roles}["critic (separate)"]
    assert math.isclose(critic.training / 1e9, 16 * 6.738415616, rel_tol=1e-9)
    assert not result.fits
    sharded = role_memory(RunSpec(model, algo="ppo"), Layout("zero3", False, 1, 8), 80.0)
    critic = {r.role: r for r in sharded.roles}["critic (separate, sharded)"]
    assert critic.training / 1e9 < 16 * 6.738415616 / 4


def test_an_engine_share_too_small_for_its_weights_cannot_start():
    model = ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, vocab=128256, intermediate=28672)
    run = RunSpec(model, algo="grpo", lora_rank=16, vllm_tensor_parallel_size=4, vllm_gpu_memory_utilization=0.3)
    result = role_memory(run, Layout("zero3", False, 1, 8), 79.6)
    assert not result.fits and "--vllm-gpu-memory-utilization" in result.blockers[0]
    roomy = role_memory(
        RunSpec(model, algo="grpo", lora_rank=16, vllm_tensor_parallel_size=4, vllm_gpu_memory_utilization=0.6),
        Layout("zero3", False, 1, 8),
        79.6,
    )
    assert not roomy.blockers
