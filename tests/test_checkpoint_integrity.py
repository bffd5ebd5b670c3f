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
from trlx_scale.reliability.checkpoint_integrity import (
    checksum_files,
    damaged_files,
    file_pieces,
    hash_share,
    share_of_pieces,
)
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
    """Each of 3 'ranks' hashes its share of a real checkpoint's pieces; no rank hashes every file, and the gathered
    result is the one-process result and the marker's."""
    path = str(two_checkpoints / "checkpoint-1")
    sizes = {
        name: os.path.getsize(os.path.join(path, name)) for name in _marker(two_checkpoints / "checkpoint-1")["files"]
    }
    shares = [hash_share(path, sizes, rank, 3) for rank in range(3)]
    assert all(0 < len(share) < len(sizes) for share in shares)
    everyone = [item for share in shares for item in share]
    merged = checksum_files(path, 2, 3, gather=lambda mine: everyone)
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


def _checkpoint_with_one_large_file(path, piece_bytes: int) -> dict[str, bytes]:
    """An optimizer state of 10.5 pieces beside three small files (the shape of a real checkpoint: one file holds
    most of the bytes)."""
    contents = {"optimizer.pt": os.urandom(piece_bytes * 21 // 2)}
    contents.update({f"rng_state_{r}.pth": os.urandom(1000 + r) for r in range(3)})
    for name, content in contents.items():
        (path / name).write_bytes(content)
    return contents


def test_hashing_is_split_by_bytes_not_files(tmp_path):
    """Dealt by files, the rank that drew optimizer.pt hashed ~all the bytes while two waited. Dealt by pieces,
    each of 3 ranks hashes a third of the bytes, give or take one piece; the gathered marker records the file as
    its pieces' digests (each the SHA-256 of those bytes), and the small files as one SHA-256 as before."""
    piece = 2**16
    contents = _checkpoint_with_one_large_file(tmp_path, piece)
    sizes = {name: len(content) for name, content in contents.items()}
    pieces = [p for name, size in sizes.items() for p in file_pieces(name, size, piece)]
    loads = [sum(p.length for p in share_of_pieces(pieces, rank, 3)) for rank in range(3)]
    assert sum(loads) == sum(sizes.values()) and max(loads) - min(loads) <= piece
    assert max(loads) < len(contents["optimizer.pt"]) / 2  # no rank hashes the large file alone
    shares = [hash_share(str(tmp_path), sizes, rank, 3, piece) for rank in range(3)]
    assert sorted(x for share in shares for x in share) == sorted(hash_share(str(tmp_path), sizes, 0, 1, piece))
    everyone = [x for share in shares for x in share]
    merged = checksum_files(str(tmp_path), 1, 3, gather=lambda mine: everyone, piece_bytes=piece)
    assert merged == checksum_files(str(tmp_path), piece_bytes=piece)
    optimizer = contents["optimizer.pt"]
    assert merged["optimizer.pt"] == {
        "bytes": len(optimizer),
        "piece_bytes": piece,
        "sha256_pieces": [
            hashlib.sha256(optimizer[i : i + piece]).hexdigest() for i in range(0, len(optimizer), piece)
        ],
    }
    small = contents["rng_state_0.pth"]
    assert merged["rng_state_0.pth"] == {"bytes": len(small), "sha256": hashlib.sha256(small).hexdigest()}
    assert damaged_files(str(tmp_path), merged) == []


def test_a_changed_byte_in_any_piece_is_found_by_whichever_rank_holds_it(tmp_path):
    piece = 2**16
    contents = _checkpoint_with_one_large_file(tmp_path, piece)
    recorded = checksum_files(str(tmp_path), piece_bytes=piece)
    optimizer = bytearray(contents["optimizer.pt"])
    optimizer[7 * piece + 5] ^= 1  # piece 7 of 11
    (tmp_path / "optimizer.pt").write_bytes(bytes(optimizer))
    found = [damaged_files(str(tmp_path), recorded, rank, 3) for rank in range(3)]
    assert sorted(found, key=len) == [
        [],
        [],
        ["optimizer.pt does not match its sha256 checksum (the bytes changed after the save)"],
    ]
    assert damaged_files(str(tmp_path), recorded) == found[[len(f) for f in found].index(1)]


def test_a_marker_from_before_pieces_is_verified_as_recorded(tmp_path):
    """Older markers hold one SHA-256 per file whatever its size: that file is checked whole, by one rank."""
    piece = 2**16
    contents = _checkpoint_with_one_large_file(tmp_path, piece)
    old = {name: {"bytes": len(c), "sha256": hashlib.sha256(c).hexdigest()} for name, c in contents.items()}
    assert [damaged_files(str(tmp_path), old, rank, 2) for rank in range(2)] == [[], []]
    _flip_one_byte(tmp_path / "optimizer.pt")  # (a last byte set to b"x" left random bytes ending in "x" unchanged)
    assert damaged_files(str(tmp_path), old) == [
        "optimizer.pt does not match its sha256 checksum (the bytes changed after the save)"
    ]
