"""What checkpoint checksums and the Hub's secret scan cost: seconds per GiB, and how the work splits over ranks.

Two checkpoint-shaped directories of random bytes (plus small JSON files), written once:

- ``--layout shards``: ``--gib`` of safetensors shards of 256 MiB (many equal files);
- ``--layout qwen2-0.5b``: a full fine-tune of Qwen2-0.5B as one process saves it: ``model.safetensors`` (494M bf16
  parameters, 0.92 GiB) and ``optimizer.pt`` (fp32 master weights and both Adam moments, 12 bytes per parameter,
  5.5 GiB): one file holds most of the bytes.

Then, ``--repeats`` times each: the marker's checksums computed (``checksum_files``, what a save adds) and verified
(``damaged_files``, what a resume adds) in one process; the recording split across ``--ranks`` simulated ranks, dealt
by pieces (``hash_share``, what trlx_scale does) and, side by side, dealt by files (every ``ranks``-th file, what it
did before), each share timed alone (a real run's wall time is its slowest rank's share); and the Hub's secret scan
of the folder for 5 secrets, reading the bytes once (``files_with_secrets``) against one search per secret over the
mapped file (what it did before). The files are in the page cache after the write, as they are right after a save; a
cold resume also pays the disk's read speed.

    python benchmarks/checkpoint_integrity.py --layout shards --gib 2 --repeats 5 --ranks 2
    python benchmarks/checkpoint_integrity.py --layout qwen2-0.5b --repeats 3 --ranks 2
    python benchmarks/checkpoint_integrity.py --extrapolate-70b --s-per-gib 0.83

``--extrapolate-70b`` writes nothing: it lays out the files of a 70B full fine-tune saved under DeepSpeed ZeRO-3 on
64 ranks (each rank's fp32 masters and Adam moments in its own optimizer file, 12 bytes per parameter / 64; its
small model-states file; the bf16 weights gathered into 30 safetensors shards) and deals them to 64 ranks both ways,
with the measured seconds per GiB of one core (``--s-per-gib``): the slowest rank's share is the save's added time.

Results and the command: docs/benchmarks.md, docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from trlx_scale.hub.secrets import files_with_secrets  # noqa: E402
from trlx_scale.reliability.checkpoint_integrity import (  # noqa: E402
    checkpoint_files,
    checksum_files,
    damaged_files,
    file_digest,
    file_pieces,
    hash_share,
    share_of_pieces,
)

SHARD = 256 * 2**20
QWEN2_05B_PARAMETERS = 494_032_768
SECRETS = [f"hf_benchmarkSecret{i}abcdefghijklmnop" for i in range(5)]


def _write_random(path: str, size: int) -> None:
    with open(path, "wb") as handle:
        while size > 0:
            block = min(SHARD, size)
            handle.write(os.urandom(block))
            size -= block


def write_checkpoint(path: str, layout: str, gib: float) -> int:
    if layout == "shards":
        total = int(gib * 2**30)
        for index, offset in enumerate(range(0, total, SHARD)):
            _write_random(os.path.join(path, f"model-{index:05d}.safetensors"), min(SHARD, total - offset))
    else:
        _write_random(os.path.join(path, "model.safetensors"), 2 * QWEN2_05B_PARAMETERS)
        _write_random(os.path.join(path, "optimizer.pt"), 12 * QWEN2_05B_PARAMETERS)
    for name in ("config.json", "trainer_state.json", "rng_state.pth"):
        with open(os.path.join(path, name), "w") as handle:
            json.dump({"name": name, "padding": "x" * 4000}, handle)
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def files_with_secrets_one_pass_per_secret(folder: str, secrets: list[str]) -> list[str]:
    """The scan before: each secret searched for in the whole mapped file, one after another."""
    needles = [secret.encode() for secret in secrets]
    hits = []
    for name in sorted(os.listdir(folder)):
        with (
            open(os.path.join(folder, name), "rb") as handle,
            mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as m,
        ):
            if any(m.find(needle) != -1 for needle in needles):
                hits.append(name)
    return hits


def _timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def zero3_70b_files(ranks: int = 64, parameters: float = 70e9) -> dict[str, int]:
    """File sizes of a 70B full fine-tune checkpoint under ZeRO-3 on ``ranks`` ranks (see the module docstring)."""
    files = {
        f"global_step100/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt": int(12 * parameters / ranks)
        for r in range(ranks)
    }
    files.update({f"global_step100/zero_pp_rank_{r}_mp_rank_00_model_states.pt": 200_000 for r in range(ranks)})
    shards = 30
    files.update(
        {f"model-{i + 1:05d}-of-{shards:05d}.safetensors": int(2 * parameters / shards) for i in range(shards)}
    )
    files.update({name: 10_000 for name in ("config.json", "trainer_state.json", "scheduler.pt")})
    files.update({f"rng_state_{r}.pth": 16_000 for r in range(ranks)})
    return files


def extrapolate(ranks: int, s_per_gib: float) -> dict:
    files = zero3_70b_files(ranks)
    total = sum(files.values())
    names = sorted(files)
    by_files = max(sum(files[n] for n in names[r::ranks]) for r in range(ranks))
    pieces = [p for name, size in files.items() for p in file_pieces(name, size)]
    by_pieces = max(sum(p.length for p in share_of_pieces(pieces, r, ranks)) for r in range(ranks))
    return {
        "checkpoint_gb": round(total / 1e9, 1),
        "ranks": ranks,
        "pieces": len(pieces),
        "even_split_gib_per_rank": round(total / ranks / 2**30, 2),
        "slowest_rank_gib_by_pieces": round(by_pieces / 2**30, 2),
        "slowest_rank_gib_by_files": round(by_files / 2**30, 2),
        "record_s_by_pieces": round(by_pieces / 2**30 * s_per_gib, 1),
        "record_s_by_files": round(by_files / 2**30 * s_per_gib, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("shards", "qwen2-0.5b"), default="shards")
    parser.add_argument("--gib", type=float, default=2.0, help="size of the 'shards' layout")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--extrapolate-70b", action="store_true", help="the 70B ZeRO-3 layout on 64 ranks, no files")
    parser.add_argument("--s-per-gib", type=float, default=0.83, help="measured SHA-256 seconds per GiB, one core")
    cli = parser.parse_args()
    if cli.extrapolate_70b:
        print(json.dumps(extrapolate(64, cli.s_per_gib), indent=1))
        return
    with tempfile.TemporaryDirectory(dir=cli.dir) as path:
        size = write_checkpoint(path, cli.layout, cli.gib)
        gib = size / 2**30
        sizes = {name: os.path.getsize(os.path.join(path, name)) for name in checkpoint_files(path)}
        runs: dict[str, list[float]] = {key: [] for key in ("record", "verify", "pieces", "files", "scan", "scan_old")}
        for _ in range(cli.repeats):
            files: dict = {}
            runs["record"].append(_timed(lambda f=files: f.update(checksum_files(path))))
            runs["verify"].append(_timed(lambda f=files: damaged_files(path, f)))
            runs["pieces"].append(
                max(_timed(lambda r=r: hash_share(path, sizes, r, cli.ranks)) for r in range(cli.ranks))
            )
            by_files = [sorted(sizes)[rank :: cli.ranks] for rank in range(cli.ranks)]
            runs["files"].append(
                max(_timed(lambda s=share: [file_digest(os.path.join(path, n)) for n in s]) for share in by_files)
            )
            runs["scan"].append(_timed(lambda: files_with_secrets(path, SECRETS)))
            runs["scan_old"].append(_timed(lambda: files_with_secrets_one_pass_per_secret(path, SECRETS)))
        median = {key: statistics.median(values) for key, values in runs.items()}
        result = {
            "layout": cli.layout,
            "gib": round(gib, 3),
            "record_s_per_gib": round(median["record"] / gib, 3),
            "verify_s_per_gib": round(median["verify"] / gib, 3),
            f"record_{cli.ranks}_ranks_by_pieces_slowest_s": round(median["pieces"], 3),
            f"record_{cli.ranks}_ranks_by_files_slowest_s": round(median["files"], 3),
            "secret_scan_one_read_s": round(median["scan"], 3),
            "secret_scan_one_pass_per_secret_s": round(median["scan_old"], 3),
            "runs": {key: [round(t, 3) for t in values] for key, values in runs.items()},
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
