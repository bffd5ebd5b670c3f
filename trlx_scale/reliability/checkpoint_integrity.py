"""Checksums of every file of a checkpoint, recorded in its completion marker and verified on resume.

A marker says the save finished; it does not say the bytes are still the ones written. Bit rot, a truncated copy
to other storage, or a partially synced object store give a checkpoint that has its marker and loads garbage (or
fails somewhere unrelated). So the marker records, for every file under the checkpoint directory (each rank's part
included: ``rng_state_<r>.pth``, ``rollout_state_rank<r>.pt``, DeepSpeed's per-rank partitions), its size and its
SHA-256, and resuming compares them.

The work is split across ranks: the sorted file list is dealt out round-robin, each rank hashes its share, and the
results are gathered, so a save or a resume costs about (checkpoint bytes / ranks) / hash rate per rank (SHA-256 runs
at about 1.4 GiB/s per core here; docs/benchmarks.md has the measured cost per GB). This assumes the checkpoint
directory is on storage every rank sees (as transformers does, unless ``save_on_each_node``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

ALGORITHM = "sha256"
_CHUNK = 8 * 2**20
# Files that are not part of what the checkpoint holds (the marker itself, its temporary name while written).
_NOT_CHECKED_PREFIX = "trlx_scale_checkpoint_complete.json"

Gather = Callable[[list], list]  # each rank's list in, every rank's items out (concatenated), on every rank


def _alone(items: list) -> list:
    return items


def checkpoint_files(path: str) -> list[str]:
    """Every file under ``path`` (relative paths, sorted), the marker excluded."""
    found = []
    for root, _, names in os.walk(path):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), path)
            if not relative.startswith(_NOT_CHECKED_PREFIX):
                found.append(relative)
    return sorted(found)


def file_digest(path: str) -> str:
    digest = hashlib.new(ALGORITHM)
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checksum_files(path: str, rank: int = 0, world_size: int = 1, gather: Gather = _alone) -> dict[str, dict]:
    """``{relative path: {"bytes": n, "sha256": hex}}`` for every file of the checkpoint; this rank hashes every
    ``world_size``-th file from ``rank`` on and ``gather`` merges the shares (call it on every rank)."""
    files = checkpoint_files(path)
    mine = []
    for name in files[rank::world_size]:
        full = os.path.join(path, name)
        mine.append((name, {"bytes": os.path.getsize(full), ALGORITHM: file_digest(full)}))
    return dict(sorted(gather(mine)))


def damaged_files(
    path: str, recorded: dict[str, dict], rank: int = 0, world_size: int = 1, gather: Gather = _alone
) -> list[str]:
    """What is wrong with the checkpoint at ``path`` against the checksums its marker recorded: one line per missing,
    resized or changed file (empty when all match). Call on every rank; each checks its share."""
    problems = []
    names = sorted(recorded)
    for name in names[rank::world_size]:
        full = os.path.join(path, name)
        expected = recorded[name]
        if not os.path.isfile(full):
            problems.append(f"{name} is missing")
        elif os.path.getsize(full) != expected["bytes"]:
            problems.append(f"{name} has {os.path.getsize(full)} bytes, {expected['bytes']} were written")
        elif file_digest(full) != expected[ALGORITHM]:
            problems.append(f"{name} does not match its {ALGORITHM} checksum (the bytes changed after the save)")
    return sorted(gather(problems))
