"""Checkpoints count only once complete: a run killed (SIGKILL) in the middle of a checkpoint write, or during
generation in a 2-process run, resumes with `resume_from_checkpoint=True` from the last complete checkpoint and
finishes; at most one save interval of steps is redone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from trlx_scale.reliability import CHECKPOINT_COMPLETE_MARKER, is_complete_checkpoint, latest_complete_checkpoint
from trlx_scale.reliability.checkpoints import resolve_resume_checkpoint

from .helpers.launch import REPO_ROOT, kill_process_tree, launch_env

SCRIPT = os.path.join(REPO_ROOT, "tests", "scripts", "interrupted_run.py")


def _command(output_dir, *extra, processes: int = 1, port: int = 29581) -> list[str]:
    if processes == 1:
        return [sys.executable, SCRIPT, str(output_dir), *extra]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    return [*launcher, "--master_port", str(port), SCRIPT, str(output_dir), *extra]


def _run_until_stalled_then_kill(command, output_dir, timeout: float = 300) -> None:
    """Start the run, wait for its stall sentinel, then SIGKILL the launcher and every process below it."""
    log = open(os.path.join(output_dir, "..", f"{os.path.basename(output_dir)}-killed-run.log"), "w")  # noqa: SIM115
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=launch_env(), stdout=log, stderr=subprocess.STDOUT)
    sentinel = os.path.join(output_dir, "stalled")
    deadline = time.monotonic() + timeout
    while not os.path.exists(sentinel):
        if process.poll() is not None:
            with open(log.name) as handle:
                raise AssertionError(f"the run ended before stalling:\n{handle.read()[-4000:]}")
        if time.monotonic() > deadline:
            kill_process_tree(process)
            raise AssertionError("the run never reached its stall point")
        time.sleep(0.2)
    kill_process_tree(process)
    log.close()
    os.remove(sentinel)


def _resume(command) -> dict:
    result = subprocess.run(command, cwd=REPO_ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return {**json.loads(line.removeprefix("RESULT ")), "log": result.stdout + result.stderr}


def _checkpoint(output_dir, step: int) -> str:
    return os.path.join(output_dir, f"checkpoint-{step}")


@pytest.mark.slow
def test_kill_during_a_checkpoint_write_resumes_from_the_previous_complete_one(tmp_path):
    _run_until_stalled_then_kill(_command(tmp_path, "--stall", "save:3"), tmp_path)
    torn = _checkpoint(tmp_path, 3)
    assert os.path.isdir(torn) and not is_complete_checkpoint(torn)  # model files written, the rest never was
    assert not os.path.exists(os.path.join(torn, "trainer_state.json"))
    assert is_complete_checkpoint(_checkpoint(tmp_path, 2))
    assert latest_complete_checkpoint(str(tmp_path)) == _checkpoint(tmp_path, 2)

    result = _resume(_command(tmp_path, "--resume"))
    assert result["resumed_from"] == _checkpoint(tmp_path, 2)
    assert "skipped checkpoint-3 (its save did not finish" in result["log"]
    assert result["trained_steps"] == [3, 4]  # the interrupted step 3 is redone, nothing before it
    for step in (1, 2, 3, 4):
        assert is_complete_checkpoint(_checkpoint(tmp_path, step)), step  # the torn one was replaced
    with open(os.path.join(_checkpoint(tmp_path, 3), CHECKPOINT_COMPLETE_MARKER)) as handle:
        assert json.load(handle)["global_step"] == 3


@pytest.mark.slow
def test_kill_during_generation_of_a_two_process_run_loses_at_most_one_save_interval(tmp_path):
    _run_until_stalled_then_kill(_command(tmp_path, "--stall", "generate:3", processes=2), tmp_path)
    assert latest_complete_checkpoint(str(tmp_path)) == _checkpoint(tmp_path, 2)  # steps 1-2 were saved
    result = _resume(_command(tmp_path, "--resume", processes=2, port=29583))
    assert result["resumed_from"] == _checkpoint(tmp_path, 2)
    assert result["trained_steps"] == [3, 4]  # lost: only step 3's rollout, less than one save interval
    assert is_complete_checkpoint(_checkpoint(tmp_path, 4))


@pytest.mark.slow
def test_kill_during_an_optimizer_step_resumes_from_the_last_checkpoint(tmp_path):
    _run_until_stalled_then_kill(_command(tmp_path, "--stall", "optimizer:3"), tmp_path)
    assert latest_complete_checkpoint(str(tmp_path)) == _checkpoint(tmp_path, 2)
    assert not os.path.exists(_checkpoint(tmp_path, 3))
    result = _resume(_command(tmp_path, "--resume"))
    assert result["resumed_from"] == _checkpoint(tmp_path, 2)
    assert result["trained_steps"] == [3, 4]


def test_resume_refuses_a_torn_checkpoint_path_and_a_directory_with_none_complete(tmp_path):
    torn = tmp_path / "checkpoint-5"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"partial")
    with pytest.raises(ValueError, match=r"torn checkpoint .*Resume from an older checkpoint-N"):
        resolve_resume_checkpoint(str(torn), str(tmp_path))
    with pytest.raises(ValueError, match=r"found no complete, intact checkpoint in output_dir"):
        resolve_resume_checkpoint(True, str(tmp_path))
    with pytest.raises(ValueError, match="is not a directory"):
        resolve_resume_checkpoint(str(tmp_path / "checkpoint-9"), str(tmp_path))
    assert resolve_resume_checkpoint(None, str(tmp_path)) is None
