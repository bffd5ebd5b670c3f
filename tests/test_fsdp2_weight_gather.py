"""Weight sync from an FSDP2-sharded policy (raw fully_shard on gloo: Accelerate runs FSDP only on accelerators), and
the merge the asynchronous trainer's FSDP2 path computes from gathered tensors (``server_weights``; its 2-process run
against a real server is in test_async_grpo.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from trlx_scale.generation import server_weights

from .helpers.launch import run_torchrun_report


def _lora(model, target_modules="all-linear", **config):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=target_modules, **config))
    with torch.no_grad():  # non-zero B: the merge is not trivially the base
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return peft_model


def test_gathered_merge_equals_peft_merge(default_model, tmp_path):
    """The merged weights computed from gathered tensors are PEFT's ``merge_adapter`` + ``write_full_weights``
    (names, tied aliases and values), and a rank that does not write keeps nothing."""
    base = {name: tensor.clone() for name, tensor in default_model.state_dict().items()}
    model = _lora(default_model)
    gathered = server_weights.gathered_full_weights(model, keep=True)
    model.merge_adapter()
    path = server_weights.write_full_weights(model, str(tmp_path / "merged"))
    expected = load_file(f"{path}/{server_weights.WEIGHTS_FILE}")
    assert sorted(gathered) == sorted(expected)
    assert max((gathered[name] - expected[name]).abs().max().item() for name in expected) <= 1e-6
    assert any((expected[name] - base[name]).abs().max().item() > 1e-3 for name in base)  # the adapter is in it


@pytest.mark.parametrize(
    "config",
    [{"use_dora": True}, {"target_modules": ["embed_tokens", "q_proj"]}],
    ids=["dora", "lora_on_embeddings"],
)
def test_gathered_merge_refuses_what_it_cannot_merge(default_model, config):
    """DoRA's merge needs the weight norm, and LoRA on embeddings keeps its adapter elsewhere: the FSDP2 path
    refuses both (before any gather) and names the ways out, instead of writing a base without their delta."""
    model = _lora(default_model, **config)
    with pytest.raises(ValueError, match="not plain LoRA on a linear layer.*ZeRO-3 or DDP"):
        server_weights.gathered_full_weights(model, keep=True)


def test_gathered_adapter_is_the_saved_adapter(default_model, tmp_path):
    """The adapter files written from gathered tensors hold what ``save_pretrained`` writes."""
    model = _lora(default_model)
    ours = server_weights.save_adapter(model, server_weights.gathered_adapter(model, keep=True), str(tmp_path / "a"))
    peft = server_weights.write_adapter(model, str(tmp_path / "b"))
    written, expected = (load_file(f"{d}/{server_weights.ADAPTER_FILE}") for d in (ours, peft))
    assert sorted(written) == sorted(expected)
    assert all(torch.equal(written[name], expected[name]) for name in expected)
    configs = [json.load(open(f"{d}/adapter_config.json")) for d in (ours, peft)]
    for config in configs:
        config["target_modules"] = sorted(config["target_modules"])  # PEFT writes a set as a list in any order
        config.pop("auto_mapping")  # which transformers class to rebuild with (AutoPeftModel): vLLM does not read it
    assert configs[0] == configs[1]


@pytest.mark.distributed
def test_fsdp2_sharded_lora_policy_sends_the_full_adapter(tmp_path):
    """FSDP2 (raw fully_shard, gloo, 2 processes): each rank holds half of every LoRA tensor; the adapter vLLM gets is
    the unsharded one, and only LoRA tensors are gathered (bytes sent = adapter size)."""
    report = run_torchrun_report("fsdp2_lora_gather.py", tmp_path / "lora.json", port=29534)
    assert report["lora_params_sharded"] and 0.4 < report["local_fraction"] < 0.6
    assert report["same_keys"] and report["max_abs_diff"] == 0.0
    assert report["bytes_sent"] == report["adapter_bytes"]


@pytest.mark.distributed
def test_fsdp2_sharded_full_policy_streams_unsharded_weights(tmp_path):
    """FSDP2 full fine-tuning: the bucketed stream gathers each DTensor and sends the unsharded weights in the engine
    dtype (bf16 here), nothing more."""
    report = run_torchrun_report("fsdp2_full_gather.py", tmp_path / "full.json", port=29535)
    assert report["sharded"] and report["same_names"] and report["all_full_shape"]
    assert report["max_abs_diff_bf16"] == 0.0 and report["dtypes"] == ["torch.bfloat16"]
    assert report["bytes"] == report["expected_bytes"]


def test_full_weights_are_written_in_the_servers_dtype(default_model, tmp_path):
    """fp32 master weights sent to a bf16 server: the file holds bf16 tensors (half the bytes), each the trainer's
    weight rounded once, from both writers (the gathered FSDP2 one and the unsharded one)."""
    model = _lora(default_model)
    gathered = server_weights.gathered_full_weights(model, keep=True)
    assert all(t.dtype == torch.float32 for t in gathered.values())
    sharded = server_weights.save_full_weights(gathered, str(tmp_path / "gathered"), torch.bfloat16)
    model.merge_adapter()
    plain = server_weights.write_full_weights(model, str(tmp_path / "plain"), torch.bfloat16)
    full = server_weights.write_full_weights(model, str(tmp_path / "full"))
    fp32 = load_file(f"{full}/{server_weights.WEIGHTS_FILE}")
    for directory, ulps in ((plain, 0), (sharded, 1)):  # the gathered merge is fp32-close: may round one ulp apart
        written = load_file(f"{directory}/{server_weights.WEIGHTS_FILE}")
        assert sorted(written) == sorted(fp32)
        assert all(written[name].dtype == torch.bfloat16 for name in written)
        for name, tensor in fp32.items():
            torch.testing.assert_close(written[name], tensor.to(torch.bfloat16), rtol=ulps * 2**-7, atol=0)
    bf16_bytes = sum(
        t.numel() * t.element_size() for t in load_file(f"{plain}/{server_weights.WEIGHTS_FILE}").values()
    )
    assert bf16_bytes * 2 == sum(t.numel() * t.element_size() for t in fp32.values())
