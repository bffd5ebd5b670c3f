"""Checksums of every file of a checkpoint, recorded in its completion marker and verified on resume.

A marker says the save finished; it does not say the bytes are still the ones written. Bit rot, a truncated copy
to other storage, or a partially synced object store give a checkpoint that has its marker and loads garbage (or
fails somewhere unrelated). So the marker records, for every file under the checkpoint directory (each rank's part
included: ``rng_state_<r>.pth``, ``rollout_state_rank<r>.pt``, DeepSpeed's per-rank partitions), its size and its
SHA-256, and resuming compares them.

Large files are recorded as pieces of ``PIECE_BYTES`` (a SHA-256 per piece, ``sha256_pieces``); a file of at most
one piece keeps one ``sha256``, as markers have always recorded it. The work is split across ranks by bytes, not by
files: every piece of every file is dealt out, largest first, to the rank with the fewest bytes so far (the same
deal on every rank: it depends only on the sorted sizes), each rank hashes its pieces, and the results are gathered.
So a save or a resume costs about (checkpoint bytes / ranks) / hash rate, give or take one piece, however the bytes
are spread over files: a checkpoint whose optimizer state is one file used to be hashed by one rank while the others
waited (SHA-256 runs at about 1.4 GiB/s per core here; docs/reliability.md has the figures and the extrapolation to
a 70B checkpoint on 64 ranks). This assumes the checkpoint directory is on storage every rank sees (as transformers
does, unless ``save_on_each_node``). Markers written before pieces (one ``sha256`` per file, whatever its size) are
verified as they were recorded, each such file as one piece.
"""

from __future__ import annotations

import hashlib
import heapq
import os
from collections.abc import Callable
from dataclasses import dataclass

from ..progress_notice import PeriodicNotice

ALGORITHM = "sha256"
_CHUNK = 8 * 2**20
# A file larger than this is hashed as several pieces, which any rank may take. 256 MiB keeps the marker small
# (a 1 TB checkpoint: about 4,000 digests, 270 KB of JSON) while a rank's share is within one piece (0.2 s at
# 1.4 GiB/s) of an exact split.
PIECE_BYTES = 256 * 2**20
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


def file_digest(path: str, offset: int = 0, length: int | None = None) -> str:
    """The SHA-256 of ``length`` bytes of ``path`` from ``offset`` (the whole file by default)."""
    digest = hashlib.new(ALGORITHM)
    remaining = os.path.getsize(path) - offset if length is None else length
    with open(path, "rb") as handle:
        handle.seek(offset)
        while remaining > 0 and (chunk := handle.read(min(_CHUNK, remaining))):
            digest.update(chunk)
            remaining -= len(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Piece:
    """``length`` bytes of file ``name`` from ``offset``: the unit of hashing work (piece ``index`` of the file)."""

    name: str
    index: int
    offset: int
    length: int


def file_pieces(name: str, size: int, piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """The pieces of a file of ``size`` bytes (an empty file is one empty piece)."""
    count = max(1, -(-size // piece_bytes))
    return [Piece(name, i, i * piece_bytes, min(piece_bytes, size - i * piece_bytes)) for i in range(count)]


def share_of_pieces(pieces: list[Piece], rank: int, world_size: int) -> list[Piece]:
    """Rank ``rank``'s pieces: largest first, each to the rank with the fewest bytes so far (ties to the lowest
    rank). A deterministic function of the pieces, so every rank computes the same deal without talking."""
    loads = [(0, r) for r in range(world_size)]
    heapq.heapify(loads)
    mine = []
    for piece in sorted(pieces, key=lambda p: (-p.length, p.name, p.index)):
        load, owner = heapq.heappop(loads)
        heapq.heappush(loads, (load + piece.length, owner))
        if owner == rank:
            mine.append(piece)
    return mine


def hash_share(
    path: str,
    sizes: dict[str, int],
    rank: int,
    world_size: int,
    piece_bytes: int = PIECE_BYTES,
    progress: PeriodicNotice | None = None,
) -> list[tuple[str, int, str]]:
    """``(file, piece index, SHA-256)`` of rank ``rank``'s share of the pieces of the files ``sizes`` lists; a large
    share says how far it is every few seconds (``progress``)."""
    pieces = [piece for name, size in sizes.items() for piece in file_pieces(name, size, piece_bytes)]
    share = share_of_pieces(pieces, rank, world_size)
    total, done = sum(piece.length for piece in share), 0
    progress = progress or PeriodicNotice(f"checksums of {path} (rank {rank})")
    digests = []
    for piece in share:
        digests.append(
            (piece.name, piece.index, file_digest(os.path.join(path, piece.name), piece.offset, piece.length))
        )
        done += piece.length
        progress.tick(
            lambda elapsed, done=done: f"{100 * done / total:.0f}% of {total / 2**30:.1f} GiB in {elapsed:.0f} s"
        )
    return digests


def _entry(size: int, digests: list[str], piece_bytes: int) -> dict:
    if len(digests) == 1:
        return {"bytes": size, ALGORITHM: digests[0]}
    return {"bytes": size, "piece_bytes": piece_bytes, f"{ALGORITHM}_pieces": digests}


def checksum_files(
    path: str, rank: int = 0, world_size: int = 1, gather: Gather = _alone, piece_bytes: int = PIECE_BYTES
) -> dict[str, dict]:
    """``{relative path: {"bytes": n, "sha256": hex}}`` for every file of the checkpoint (``"sha256_pieces"`` and
    ``"piece_bytes"`` instead of ``"sha256"`` for a file of several pieces); this rank hashes its share of the
    bytes and ``gather`` merges the shares (call it on every rank)."""
    sizes = {name: os.path.getsize(os.path.join(path, name)) for name in checkpoint_files(path)}
    mine = hash_share(path, sizes, rank, world_size, piece_bytes)
    digests: dict[str, dict[int, str]] = {}
    for name, index, digest in gather(mine):
        digests.setdefault(name, {})[index] = digest
    return {
        name: _entry(sizes[name], [digests[name][i] for i in sorted(digests[name])], piece_bytes)
        for name in sorted(sizes)
    }


def _recorded_pieces(name: str, entry: dict) -> list[tuple[Piece, str]]:
    """The pieces a marker's entry recorded, with their digests (an entry of one ``sha256``: the whole file)."""
    pieces = entry.get(f"{ALGORITHM}_pieces")
    if pieces is None:
        return [(Piece(name, 0, 0, entry["bytes"]), entry[ALGORITHM])]
    return list(zip(file_pieces(name, entry["bytes"], entry["piece_bytes"]), pieces, strict=True))


def damaged_files(
    path: str, recorded: dict[str, dict], rank: int = 0, world_size: int = 1, gather: Gather = _alone
) -> list[str]:
    """What is wrong with the checkpoint at ``path`` against the checksums its marker recorded: one line per missing,
    resized or changed file (empty when all match). Call on every rank; each checks its share of the bytes (the
    owner of a file's first piece also checks that it exists and has its size)."""
    expected = {piece: digest for name in sorted(recorded) for piece, digest in _recorded_pieces(name, recorded[name])}
    problems = set()
    for piece in share_of_pieces(list(expected), rank, world_size):
        full = os.path.join(path, piece.name)
        size = recorded[piece.name]["bytes"]
        if not os.path.isfile(full):
            if piece.index == 0:
                problems.add(f"{piece.name} is missing")
        elif os.path.getsize(full) != size:
            if piece.index == 0:
                problems.add(f"{piece.name} has {os.path.getsize(full)} bytes, {size} were written")
        elif file_digest(full, piece.offset, piece.length) != expected[piece]:
            problems.add(f"{piece.name} does not match its {ALGORITHM} checksum (the bytes changed after the save)")
    return sorted(set(gather(sorted(problems))))
