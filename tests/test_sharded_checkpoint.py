"""Sharded checkpoints (torch.distributed.checkpoint) under FSDP2, with raw ``fully_shard`` under torchrun (gloo):
each rank writes only its shards, synchronously or in the background; a checkpoint of 2 ranks resumes on 1 and one
of 1 resumes on 2, continuing the run; a process killed during an asynchronous save leaves a checkpoint without a
completion marker, and the run resumes from the previous one.

Tolerance: a resumed run at another world size sums its gradients and losses in another order (FSDP2's
reduce-scatter over 2 ranks against none), so its losses match the straight run's to fp32 rounding, not bit for bit:
relative 1e-5 here (the differences seen are ~1e-7). At the same world size the match is exact."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from trlx_scale.reliability import is_complete_checkpoint, latest_complete_checkpoint

from .helpers.launch import ACCELERATE_LAUNCH, REPO_ROOT, kill_process_tree, launch_env

SCRIPT = os.path.join(REPO_ROOT, "tests", "distributed", "sharded_checkpoint_run.py")


def _command(processes: int, port: int, report, phase: str, output_dir, *extra) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    return [*launcher, "--master_port", str(port), SCRIPT, str(report), phase, str(output_dir), *extra]


def _run(processes: int, port: int, tmp_path, phase: str, output_dir, *extra) -> dict:
    report = tmp_path / f"{phase}-{processes}-{port}.json"
    result = subprocess.run(
        _command(processes, port, report, phase, output_dir, *extra),
        cwd=REPO_ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(report.read_text())


_STRAIGHT_RUNS: dict[tuple[int, bool], dict] = {}  # (processes, LoRA) -> report: one straight run per world and model


def _straight(processes: int, lora: bool, tmp_path_factory) -> dict:
    """The uninterrupted run's report (``--asynchronous`` only changes how a save is written, and this run saves
    nothing, so the synchronous and asynchronous tests share it)."""
    key = (processes, lora)
    if key not in _STRAIGHT_RUNS:
        directory = tmp_path_factory.mktemp("straight")
        extra = ["--lora"] if lora else []
        _STRAIGHT_RUNS[key] = _run(processes, 29601, directory, "straight", directory / "run", *extra)
    return _STRAIGHT_RUNS[key]


def _close(resumed: dict, straight: dict, steps) -> None:
    for step in steps:
        ours, theirs = resumed["losses"][str(step)], straight["losses"][str(step)]
        assert math.isclose(ours, theirs, rel_tol=1e-5), (step, ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saving", "resuming", "mode", "model"),
    [(2, 1, "sync", "full"), (1, 2, "async", "full"), (2, 1, "async", "lora")],
)
def test_a_sharded_checkpoint_resumes_at_another_world_size(tmp_path, tmp_path_factory, saving, resuming, mode, model):
    extra = (["--asynchronous"] if mode == "async" else []) + (["--lora"] if model == "lora" else [])
    straight = _straight(saving, model == "lora", tmp_path_factory)
    saved = _run(saving, 29603, tmp_path, "save", tmp_path / "run", "--save_at", "2", *extra)
    assert saved["losses"] == straight["losses"]  # saving (in the background too) changes nothing: exact
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert is_complete_checkpoint(str(checkpoint)) and saved["consolidated_ok"]
    files = json.loads((checkpoint / "trlx_scale_checkpoint_complete.json").read_text())["files"]
    shards = [name for name in files if name.endswith(".distcp")]
    model_shards = [name for name in shards if name.startswith("pytorch_model_fsdp_0/")]
    assert len(model_shards) == saving and len(shards) == 2 * saving  # each rank wrote its own shard files
    assert "pytorch_model_fsdp_0/.metadata" in files and "optimizer_0/.metadata" in files  # Accelerate's layout
    resumed = _run(resuming, 29605, tmp_path, "resume", tmp_path / "run", *extra)
    assert resumed["resumed_from"] == "checkpoint-2" and resumed["world_size"] == resuming
    assert sorted(resumed["losses"]) == ["3", "4"]
    _close(resumed, straight, (3, 4))


@pytest.mark.slow
def test_a_kill_during_an_asynchronous_save_leaves_the_previous_checkpoint_in_use(tmp_path, tmp_path_factory):
    straight = _straight(2, False, tmp_path_factory)
    log = open(tmp_path / "killed.log", "w")  # noqa: SIM115
    command = _command(2, 29613, tmp_path / "unused.json", "save", tmp_path / "run", "--save_at", "1", "2")
    process = subprocess.Popen(
        [*command, "--asynchronous", "--slow_last_save"],
        cwd=REPO_ROOT,
        env=launch_env(),
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not (tmp_path / "run" / "writing").exists():
        assert process.poll() is None, (tmp_path / "killed.log").read_text()[-4000:]
        assert time.monotonic() < deadline, "the run never reached its second save"
        time.sleep(0.1)
    kill_process_tree(process)  # the launcher and both ranks, mid-write
    log.close()
    assert (tmp_path / "run" / "checkpoint-2").is_dir()
    assert not is_complete_checkpoint(str(tmp_path / "run" / "checkpoint-2"))  # no marker: never resumed from
    assert latest_complete_checkpoint(str(tmp_path / "run")) == str(tmp_path / "run" / "checkpoint-1")
    resumed = _run(2, 29615, tmp_path, "resume", tmp_path / "run")
    assert resumed["resumed_from"] == "checkpoint-1" and sorted(resumed["losses"]) == ["2", "3", "4"]
    assert resumed["losses"] == {key: straight["losses"][key] for key in ("2", "3", "4")}  # same world: exact


def _deepspeed_run(output_dir, processes: int, port: int, *extra) -> dict:
    """tests/scripts/interrupted_run.py (LoRA GRPO, 4 steps, a checkpoint every 2) under ZeRO-3 (cpu_zero3.yaml)."""
    script = os.path.join(REPO_ROOT, "tests", "scripts", "interrupted_run.py")
    config = os.path.join(REPO_ROOT, "configs", "accelerate", "cpu_zero3.yaml")
    command = [*ACCELERATE_LAUNCH, "--config_file", config, "--num_processes", str(processes)]
    command += ["--main_process_port", str(port), script, str(output_dir), "--save_steps", "2", *extra]
    done = subprocess.run(command, cwd=REPO_ROOT, env=launch_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return {**json.loads(line.removeprefix("RESULT ")), "log": done.stdout + done.stderr}


@pytest.mark.slow
@pytest.mark.parametrize(("saving", "resuming"), [(2, 1), (1, 2)])
def test_a_deepspeed_zero3_checkpoint_resumes_at_another_world_size(tmp_path, saving, resuming):
    """DeepSpeed's per-rank partitions load only at the world size that wrote them; the trainer converts the
    checkpoint to DeepSpeed's universal format once and resumes from that: the adapter it trains from is exactly the
    one saved (the checkpoint's consolidated adapter_model.safetensors, written by zero3_save_16bit_model), and the
    run finishes. (Its later losses are not compared with the straight run: under ZeRO-3 1 and 2 processes already
    differ from step 2 on, resumed or not.)"""
    from safetensors.torch import load_file

    straight = _deepspeed_run(tmp_path / "run", saving, 29621, "--per_device_train_batch_size", str(8 // saving))
    assert is_complete_checkpoint(str(tmp_path / "run" / "checkpoint-2"))
    for name in os.listdir(tmp_path / "run"):  # keep checkpoint-2 only: the resume starts there
        if name.startswith("checkpoint-") and name != "checkpoint-2":
            subprocess.run(["rm", "-rf", str(tmp_path / "run" / name)], check=True)
    dump = tmp_path / "loaded.json"
    resumed = _deepspeed_run(
        tmp_path / "run",
        resuming,
        29623,
        "--resume",
        "--per_device_train_batch_size",
        str(8 // resuming),
        "--dump_loaded_weights",
        str(dump),
    )
    assert resumed["resumed_from"] == str(tmp_path / "run" / "checkpoint-2")
    assert f"was saved by {saving} processes and this run has {resuming}" in resumed["log"]
    assert (tmp_path / "run" / "checkpoint-2" / "latest_universal").is_file()
    assert resumed["trained_steps"] == [3, 4] and sorted(resumed["logged"]) == ["1", "2", "3", "4"]
    assert resumed["logged"]["2"] == straight["logged"]["2"]  # the history came back with the checkpoint
    saved = load_file(str(tmp_path / "run" / "checkpoint-2" / "adapter_model.safetensors"))
    loaded = json.loads(dump.read_text())
    assert len(loaded) == len(saved) > 0
    for name, values in loaded.items():
        expected = saved[name.replace(".default", "")].flatten().tolist()
        assert values == expected, name  # bit for bit: fp32 masters in, fp32 weights out
