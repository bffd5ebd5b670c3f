"""configs/accelerate/: generated, loadable by Accelerate's own loader, and checked before a job starts."""

import os

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from trlx_scale.cli import main as cli_main
from trlx_scale.launch_config import SHIPPED_CONFIGS, LaunchPlan

from .helpers.launch import REPO_ROOT

CONFIG_DIR = os.path.join(REPO_ROOT, "configs", "accelerate")


@pytest.mark.parametrize("name", sorted(SHIPPED_CONFIGS))
def test_shipped_config_is_generated_and_loads_through_accelerate(name):
    path = os.path.join(CONFIG_DIR, name)
    with open(path) as handle:
        assert handle.read() == SHIPPED_CONFIGS[name].to_yaml(), (
            f"configs/accelerate/{name} is stale: run scripts/write_accelerate_configs.py"
        )
    plan = SHIPPED_CONFIGS[name]
    config = load_config_from_file(path)
    assert config.num_processes == plan.world_size and config.num_machines == plan.nodes
    assert (
        getattr(config.mixed_precision, "value", config.mixed_precision) == "bf16"
    )  # bf16 compute; fp32 masters in optimizer/shards
    if plan.backend == "fsdp2":
        assert config.distributed_type.value == "FSDP"
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"  # per-rank shards, no rank-0 gather
        assert config.fsdp_config["fsdp_offload_params"] is plan.offload
    elif plan.backend == "zero3":
        assert config.distributed_type.value == "DEEPSPEED"
        assert config.deepspeed_config["zero_stage"] == 3 and config.deepspeed_config["zero3_save_16bit_model"]
        assert config.deepspeed_config["offload_optimizer_device"] == ("cpu" if plan.offload else "none")
    if plan.nodes > 1:
        assert config.main_process_ip == "MAIN_NODE_IP" and config.main_process_port == 29500


@pytest.mark.parametrize(
    ("name", "distributed_type"), [("cpu_ddp.yaml", "MULTI_GPU"), ("cpu_zero3.yaml", "DEEPSPEED")]
)
def test_cpu_configs_load(name, distributed_type):
    config = load_config_from_file(os.path.join(CONFIG_DIR, name))
    assert config.distributed_type.value == distributed_type and config.num_processes == 2
    assert getattr(config.mixed_precision, "value", config.mixed_precision) == "no" and not config.use_cpu


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (LaunchPlan(gpus_per_node=4, vllm_tensor_parallel_size=3), r"must divide gpus_per_node \(4\).*\[1, 2, 4\]"),
        (LaunchPlan(gpus_per_node=2, per_device_train_batch_size=3, num_generations=4), "multiple of num_generations"),
        (LaunchPlan(backend="ddp", offload=True), "offload needs a sharded backend"),
        (LaunchPlan(backend="megatron"), "backend must be one of"),
        (LaunchPlan(num_generations=1), "at least 2"),
        (LaunchPlan(nodes=0), "must be at least 1"),
    ],
)
def test_impossible_plans_are_refused_with_the_fix(plan, message):
    with pytest.raises(ValueError, match=message):
        plan.validate()


def test_tensor_parallel_groups_inside_a_node():
    plan = LaunchPlan(
        nodes=2, gpus_per_node=8, backend="fsdp2", vllm_tensor_parallel_size=2, main_process_ip="10.0.0.1"
    )
    text = plan.to_yaml()
    assert "8 colocated vLLM engine(s)" in text and "NOTE" not in text
    assert "main_process_ip: 10.0.0.1" in text


def test_cli_writes_a_config_atomically_and_reports_errors(tmp_path, capsys):
    output = tmp_path / "job.yaml"
    assert cli_main(["accelerate-config", "--nodes", "2", "--backend", "zero3", "--output", str(output)]) == 0
    config = load_config_from_file(str(output))
    assert config.num_processes == 16 and config.distributed_type.value == "DEEPSPEED"
    assert "set main_process_ip" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["job.yaml"]
    bad = ["accelerate-config", "--gpus-per-node", "4", "--vllm-tensor-parallel-size", "3", "--output", str(output)]
    assert cli_main(bad) == 2
    assert "must divide gpus_per_node" in capsys.readouterr().err
