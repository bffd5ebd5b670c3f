"""PPO under DeepSpeed ZeRO-3 on 2 CPU processes (`accelerate launch`, gloo): every role is partitioned like the policy
(each rank holds about half of the critic's parameters, fp32 masters and Adam moments, and of the reference model),
the shared-base critic trains as a parameter group of the policy's engine, and a run resumes its critic from a
checkpoint (the resumed step logs the same loss). The numbers match 1 process in test_process_count_equivalence.py.
Under FSDP2 (raw fully_shard under torchrun) the separate critic is sharded, trains like 1 process and resumes."""

from __future__ import annotations

import json
import os

import pytest

from .helpers.launch import ACCELERATE_LAUNCH, REPO_ROOT, run_command, run_torchrun_report

SCRIPT = os.path.join(REPO_ROOT, "tests", "distributed", "ppo_zero3_partitions.py")
CONFIG = os.path.join(REPO_ROOT, "configs", "accelerate", "cpu_zero3.yaml")


def _run(kind: str, out, port: int) -> list[dict]:
    command = [*ACCELERATE_LAUNCH, "--config_file", CONFIG, "--main_process_port", str(port), SCRIPT, kind, str(out)]
    run_command(command, timeout=900)
    reports = []
    for rank in range(2):
        with open(out / f"rank{rank}.json") as handle:
            reports.append(json.load(handle))
    return reports


def _about_half(held: dict) -> bool:
    """This rank's partition is half of the full size (DeepSpeed pads each parameter to a multiple of 2)."""
    return 0 < held["full"] and abs(held["local"] - held["full"] / 2) <= held.get("padding", 0) + 64


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("kind", "port"), [("separate", 29721), ("full", 29722), ("shared_base", 29723)])
def test_ppo_roles_are_partitioned_under_zero3(kind, port, tmp_path):
    reports = _run(kind, tmp_path, port)
    for report in reports:
        assert report["world_size"] == 2
        assert _about_half(report["critic"]), report["critic"]
        assert _about_half(report["policy"]), report["policy"]
        # Resuming from checkpoint-1 (the DeepSpeed critic's partitions, or the shared-base critic in the policy's
        # engine) retrains step 2 to the same loss.
        assert report["resumed_losses"] == report["losses"] and len(report["losses"]) == 2
    if kind == "shared_base":
        assert reports[0]["critic_group_lr"] == 1e-3 and reports[0]["policy_group_lr"] == 1e-4
        assert "critic_gib" not in reports[0]["held_gib"]  # its states are the policy engine's
        return
    for report in reports:
        assert report["critic_backend"] == "deepspeed"
        # The full critic trains every parameter: its fp32 masters are this rank's partition, Adam keeps two moments.
        assert report["critic_optimizer"]["masters"] == report["critic"]["local"]
        assert report["critic_optimizer"]["moments"] == 2 * report["critic_optimizer"]["masters"]
        # The logged memory/held/critic_gib: per local element, the fp32 parameter partition, its master and its
        # gradient partition (4 B each) and the two moments (8 B).
        critic_elements = report["critic"]["local"] + 2 * report["critic_optimizer"]["masters"]
        critic_bytes = 4 * (critic_elements + report["critic_optimizer"]["moments"])
        assert report["held_gib"]["critic_gib"] == pytest.approx(critic_bytes / 2**30, rel=1e-3)  # logged to 1e-6 GiB
        if kind == "full":
            assert report["held_gib"]["reference_gib"] == pytest.approx(
                4 * report["reference"]["local"] / 2**30, rel=1e-3
            )
        assert "critic_deepspeed" in report["checkpoint_files"]
    assert reports[0]["critic"]["local"] + reports[1]["critic"]["local"] >= reports[0]["critic"]["full"]
    if kind == "full":
        for report in reports:
            assert _about_half(report["reference"]), report["reference"]


@pytest.mark.distributed
@pytest.mark.parametrize(("kind", "port"), [("full", 29536), ("lora", 29537)])
def test_separate_critic_sharded_by_fsdp2_trains_like_one_process(kind, port, tmp_path):
    """FSDP2 (raw fully_shard on gloo, 2 processes: Accelerate runs FSDP only on accelerators): the separate critic,
    full or LoRA, holds half of its trainable parameters and Adam moments per rank as DTensor shards; 3 steps on 2 x 4
    rows give the losses, pre-clipping gradient norms and parameters of 1 process on 8 rows (fp32, summation order
    only: 1e-5 relative); a critic resumed from its checkpoint takes the same next step."""
    report = run_torchrun_report("ppo_fsdp2_critic.py", tmp_path / "critic.json", port=port, arguments=[kind])
    assert report["all_dtensor"] and report["optimizer_points_at_shards"]
    assert 0.49 < report["param_fraction"] < 0.51 and 0.49 < report["moment_fraction"] < 0.51
    assert 0.49 < report["held_ratio"] < 0.51  # memory/held/critic_gib: half of one process's (weights + moments)
    assert report["losses"] == pytest.approx(report["reference_losses"], rel=1e-5)
    assert report["norms"] == pytest.approx(report["reference_norms"], rel=1e-5)
    assert min(report["norms"]) > 0.5  # above max_grad_norm: the clipped update is what is compared
    assert report["backbone_change"] > 1e-4 and report["max_param_diff"] < 1e-5
    assert report["saved_keys"] == ["critic", "critic_optimizer_fsdp2"]
    assert report["resumed_loss"] == pytest.approx(report["next_loss"], rel=1e-6)
    assert report["resumed_norm"] == pytest.approx(report["next_norm"], rel=1e-6)


def test_critic_backend_follows_the_accelerators_fsdp_plugin(caplog):
    """Under Accelerate's FSDP2 the critic is sharded with the policy's own fully_shard options (the plugin's
    resharding, offload and mixed-precision policy, as accelerate.utils.fsdp2_prepare_model passes them); FSDP1
    keeps a DDP replica and says so. (Accelerate runs FSDP only on accelerators: its state is stood in for here.)"""
    import logging
    from types import SimpleNamespace

    import torch
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from trlx_scale.ppo.critic_training import CriticBackend

    def accelerator(plugin):
        state = SimpleNamespace(fsdp_plugin=plugin)
        return SimpleNamespace(
            distributed_type=DistributedType.FSDP, state=state, num_processes=2, device=torch.device("cpu")
        )

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy="bf16", cpu_offload=True)
    backend = CriticBackend.for_accelerator(accelerator(plugin))
    assert backend.kind == "fsdp2" and backend.num_processes == 2
    assert backend.fsdp2_kwargs["mp_policy"].param_dtype == torch.bfloat16
    assert backend.fsdp2_kwargs["offload_policy"] is plugin.cpu_offload
    assert backend.fsdp2_kwargs["reshard_after_forward"] is True and "mesh" not in backend.fsdp2_kwargs
    with caplog.at_level(logging.WARNING, logger="trlx_scale.ppo.critic_training"):
        legacy = CriticBackend.for_accelerator(accelerator(FullyShardedDataParallelPlugin(fsdp_version=1)))
    assert legacy.kind == "ddp" and "DDP replica under FSDP1" in caplog.text


@pytest.mark.distributed
def test_separate_critic_engine_builds_under_zero3_with_bf16(tmp_path):
    """ZeRO-3 with bf16 on (as on GPUs) and fp32 master weights: the critic's bf16 backbone and fp32 value head go to
    one engine whose flat partitions take one dtype; the head is cast to bf16 first and the engine keeps fp32
    masters (tests/distributed/ppo_zero3_bf16_critic.py)."""
    deepspeed_json = tmp_path / "zero3_bf16.json"
    deepspeed_json.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3},
                "bf16": {"enabled": True},
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": "auto",
            }
        )
    )
    config = tmp_path / "zero3_bf16.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
        f"  deepspeed_config_file: {deepspeed_json}\n  zero3_init_flag: false\nnum_processes: 2\nnum_machines: 1\n"
        "machine_rank: 0\nmain_training_function: main\nuse_cpu: false\nrdzv_backend: static\nsame_network: true\n"
    )
    script = os.path.join(REPO_ROOT, "tests", "distributed", "ppo_zero3_bf16_critic.py")
    out = tmp_path / "out"
    out.mkdir()
    command = [*ACCELERATE_LAUNCH, "--config_file", str(config), "--main_process_port", "29597", script, str(out)]
    run_command(command, timeout=600)
    for rank in range(2):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert report["backend"] == "deepspeed" and report["partitioned"]
        assert report["param_dtypes"] == ["torch.bfloat16"] and report["master_dtypes"] == ["torch.float32"]
