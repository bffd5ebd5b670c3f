"""Two "machines" on localhost: two `accelerate launch` invocations (--num_machines 2, machine_rank 0 and 1, main
process 127.0.0.1), each node one CPU process with its own vLLM engine. Both nodes must end with identical weights."""

import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from .helpers.launch import ACCELERATE_LAUNCH, REPO_ROOT

EXAMPLE = os.path.join(REPO_ROOT, "examples", "grpo.py")


def _launch_two_nodes(config_name, tmp_path, port, extra_launch_args=()):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    config = os.path.join(REPO_ROOT, "configs", "accelerate", config_name)
    processes = []
    for rank in (0, 1):
        command = [*ACCELERATE_LAUNCH, "--config_file", config, "--num_machines", "2", "--num_processes", "2"]
        command += ["--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
        command += [*extra_launch_args, EXAMPLE, "--max_steps", "2", "--eval_size", "20"]
        command += ["--output_dir", str(tmp_path / f"node{rank}"), "--save_on_each_node", "true"]
        log = open(tmp_path / f"node{rank}.log", "w")
        processes.append((subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=log), log))
    for process, log in processes:
        try:
            process.wait(timeout=900)
        finally:
            if process.poll() is None:
                process.kill()
            log.close()
    for rank, (process, _) in enumerate(processes):
        assert process.returncode == 0, (tmp_path / f"node{rank}.log").read_text()[-6000:]
    return [load_file(str(tmp_path / f"node{rank}" / "adapter_model.safetensors")) for rank in (0, 1)]


def _assert_identical_and_trained(node0, node1):
    assert node0.keys() == node1.keys() and len(node0) > 0
    assert all(torch.equal(node0[k], node1[k]) for k in node0)
    assert any(v.abs().sum() > 0 for k, v in node0.items() if "lora_B" in k), "LoRA B starts at zero: no update"


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_ddp_end_with_identical_weights(tmp_path):
    _assert_identical_and_trained(*_launch_two_nodes("cpu_ddp.yaml", tmp_path, port=29561))


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_zero3_end_with_identical_weights(tmp_path):
    nodes = _launch_two_nodes(
        "cpu_zero3.yaml", tmp_path, port=29562, extra_launch_args=("--deepspeed_multinode_launcher", "standard")
    )
    _assert_identical_and_trained(*nodes)
