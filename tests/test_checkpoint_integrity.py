"""Checkpoint integrity and disk space: the completion marker records every file's size and SHA-256, resume
verifies them (a damaged checkpoint by path is refused naming the file; resume-latest falls back to the previous
intact one); a save that would not fit is refused before it starts, and a disk that fills during a save gives an
error naming the directory and the bytes, with the previous checkpoint intact and resumable."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig
from transformers import TrainerCallback

from trlx_scale import GRPOTrainer
from trlx_scale.reliability import CHECKPOINT_COMPLETE_MARKER, is_complete_checkpoint
from trlx_scale.reliability.checkpoint_integrity import checksum_files, damaged_files
from trlx_scale.reliability.checkpoints import resolve_resume_checkpoint
from trlx_scale.reliability.disk_space import CheckpointDiskSpaceError, is_out_of_space
from trlx_scale.tasks import addition_dataset, exact_match_reward

from .helpers.launch import REPO_ROOT, launch_env
from .helpers.trainers import small_grpo_config

LORA = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")


def _trainer(model_dir, output_dir, cls=GRPOTrainer, **overrides):
    args = small_grpo_config(output_dir, save_strategy="steps", save_steps=1, **overrides)
    return cls(model_dir, exact_match_reward, args, train_dataset=addition_dataset("train", size=32), peft_config=LORA)


class _RecordSteps(TrainerCallback):
    def __init__(self):
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def _marker(checkpoint) -> dict:
    return json.loads((checkpoint / CHECKPOINT_COMPLETE_MARKER).read_text())


def _flip_one_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def two_checkpoints(default_model_dir, tmp_path_factory):
    """A 2-step LoRA GRPO run saving every step (checkpoint-1, checkpoint-2); tests copy it before damaging it."""
    output_dir = tmp_path_factory.mktemp("integrity-run")
    _trainer(default_model_dir, output_dir).train()
    return output_dir


def _copy_run(source, destination):
    subprocess.run(["cp", "-a", f"{source}/.", str(destination)], check=True)
    return destination


def test_the_marker_records_size_and_sha256_of_every_file(two_checkpoints):
    checkpoint = two_checkpoints / "checkpoint-2"
    recorded = _marker(checkpoint)
    assert recorded["global_step"] == 2 and recorded["algorithm"] == "sha256"
    on_disk = sorted(
        os.path.relpath(os.path.join(root, name), checkpoint)
        for root, _, names in os.walk(checkpoint)
        for name in names
        if name != CHECKPOINT_COMPLETE_MARKER
    )
    assert sorted(recorded["files"]) == on_disk  # every file, trlx_scale's rollout state and the RNG state included
    assert {"adapter_model.safetensors", "optimizer.pt", "rng_state.pth", "rollout_state_rank0.pt"} <= set(on_disk)
    for name, entry in recorded["files"].items():
        content = (checkpoint / name).read_bytes()
        assert entry == {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}, name


def test_a_damaged_file_is_refused_by_path_and_resume_latest_falls_back(
    two_checkpoints, tmp_path, default_model_dir, caplog
):
    run = _copy_run(two_checkpoints, tmp_path / "run")
    _flip_one_byte(run / "checkpoint-2" / "adapter_model.safetensors")  # one bit of rot
    with pytest.raises(
        ValueError,
        match=r"checkpoint-2' is damaged: adapter_model\.safetensors does not match its sha256 checksum .*"
        r"Resume from an older checkpoint-N",
    ):
        resolve_resume_checkpoint(str(run / "checkpoint-2"), str(run))
    with caplog.at_level(logging.WARNING):
        assert resolve_resume_checkpoint(True, str(run)) == str(run / "checkpoint-1")
    assert "skipped checkpoint-2 (damaged: adapter_model.safetensors does not match" in caplog.text
    # The trainer takes the same path: it resumes from checkpoint-1 and trains step 2 again.
    trainer = _trainer(default_model_dir, run)
    recorder = _RecordSteps()
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=True)
    assert recorder.steps == [2]
    assert (
        is_complete_checkpoint(str(run / "checkpoint-2"))
        and damaged_files(str(run / "checkpoint-2"), _marker(run / "checkpoint-2")["files"]) == []
    )  # saved again, intact


def test_truncated_and_missing_files_are_named(two_checkpoints, tmp_path):
    run = _copy_run(two_checkpoints, tmp_path / "run")
    optimizer = run / "checkpoint-2" / "optimizer.pt"
    size = optimizer.stat().st_size
    optimizer.write_bytes(optimizer.read_bytes()[: size // 2])  # a copy cut short
    os.remove(run / "checkpoint-2" / "rng_state.pth")
    problems = damaged_files(str(run / "checkpoint-2"), _marker(run / "checkpoint-2")["files"])
    assert problems == [f"optimizer.pt has {size // 2} bytes, {size} were written", "rng_state.pth is missing"]
    # With verification off the damaged checkpoint is taken as it is (the user's explicit choice).
    assert resolve_resume_checkpoint(str(run / "checkpoint-2"), str(run), verify=None) == str(run / "checkpoint-2")


def test_an_unreadable_marker_counts_as_damage(two_checkpoints, tmp_path, caplog):
    run = _copy_run(two_checkpoints, tmp_path / "run")
    marker = run / "checkpoint-2" / CHECKPOINT_COMPLETE_MARKER
    marker.write_bytes(marker.read_bytes()[:40])  # the marker itself cut short
    with pytest.raises(
        ValueError, match=r"checkpoint-2' is damaged: its trlx_scale_checkpoint_complete\.json is unread"
    ):
        resolve_resume_checkpoint(str(run / "checkpoint-2"), str(run))
    with caplog.at_level(logging.WARNING):
        assert resolve_resume_checkpoint(True, str(run)) == str(run / "checkpoint-1")


def test_hashing_split_across_ranks_gives_the_whole_checkpoint(two_checkpoints):
    """Each of 3 'ranks' hashes every third file; the gathered result is the one-process result."""
    path = str(two_checkpoints / "checkpoint-1")
    shares = [checksum_files(path, rank, 3) for rank in range(3)]
    assert all(len(share) < len(_marker(two_checkpoints / "checkpoint-1")["files"]) for share in shares)
    merged = {name: entry for share in shares for name, entry in share.items()}
    assert merged == checksum_files(path) == _marker(two_checkpoints / "checkpoint-1")["files"]


class _SmallDisk(GRPOTrainer):
    """The disk has room for one checkpoint's worth only after the first save."""

    free_bytes = 10**12

    def _free_disk_bytes(self, directory: str) -> int:
        return self.free_bytes

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        self.free_bytes = 1000  # the first save filled the disk


def test_a_save_that_does_not_fit_is_refused_before_it_starts(default_model_dir, tmp_path):
    trainer = _trainer(default_model_dir, tmp_path, cls=_SmallDisk)
    with pytest.raises(CheckpointDiskSpaceError) as raised:
        trainer.train()
    needed = sum(entry["bytes"] for entry in _marker(tmp_path / "checkpoint-1")["files"].values())
    message = str(raised.value)
    assert f"Not enough disk space to save {tmp_path / 'checkpoint-2'}: 0.00 GiB (1000 bytes) free" in message
    assert f"needs about {needed / 2**30:.2f} GiB ({needed} bytes; the size of checkpoint-1)" in message
    assert not (tmp_path / "checkpoint-2").exists()  # nothing half-written
    assert is_complete_checkpoint(str(tmp_path / "checkpoint-1"))


class _DiskFillsDuringSave(GRPOTrainer):
    """The second save's optimizer state goes to /dev/full: the kernel answers ENOSPC, torch reports 'unexpected
    pos', exactly as on a full disk."""

    def _save_optimizer_and_scheduler(self, output_dir):
        if self.state.global_step == 2:
            torch.save(self.optimizer.state_dict(), "/dev/full")
        super()._save_optimizer_and_scheduler(output_dir)


def test_a_disk_that_fills_during_a_save_names_the_directory_and_resume_works(default_model_dir, tmp_path):
    trainer = _trainer(default_model_dir, tmp_path, cls=_DiskFillsDuringSave)
    with pytest.raises(CheckpointDiskSpaceError) as raised:
        trainer.train()
    message = str(raised.value)
    assert f"The disk ran out of space while saving {tmp_path / 'checkpoint-2'}" in message
    assert "bytes) free, the checkpoint needs about" in message and "unexpected pos" in message
    assert is_out_of_space(raised.value.__cause__)
    assert not is_complete_checkpoint(str(tmp_path / "checkpoint-2"))  # torn, so never resumed from
    assert resolve_resume_checkpoint(True, str(tmp_path)) == str(tmp_path / "checkpoint-1")
    _trainer(default_model_dir, tmp_path).train(resume_from_checkpoint=True)  # once there is room
    assert is_complete_checkpoint(str(tmp_path / "checkpoint-2"))


@pytest.mark.slow
def test_two_processes_hash_their_shares_and_find_a_damaged_rank_file(tmp_path):
    """Under torchrun with 2 processes: the marker covers both ranks' files; a damaged rank-1 RNG state is found
    by the split verification and the run resumes from the previous checkpoint."""
    script = os.path.join(REPO_ROOT, "tests", "scripts", "interrupted_run.py")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29587"]

    def run(*extra):
        result = subprocess.run(
            [*launcher, script, str(tmp_path), "--max_steps", "2", *extra],
            cwd=REPO_ROOT,
            env=launch_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
        return result

    run()
    files = _marker(tmp_path / "checkpoint-2")["files"]
    assert {"rng_state_0.pth", "rng_state_1.pth", "rollout_state_rank0.pt", "rollout_state_rank1.pt"} <= set(files)
    _flip_one_byte(tmp_path / "checkpoint-2" / "rng_state_1.pth")
    result = run("--resume", "--max_steps", "3")
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    assert json.loads(line.removeprefix("RESULT "))["trained_steps"] == [2, 3]
    assert "skipped checkpoint-2 (damaged: rng_state_1.pth does not match its sha256 checksum" in result.stderr
