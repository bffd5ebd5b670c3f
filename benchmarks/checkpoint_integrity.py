"""What checkpoint checksums cost: seconds per GiB to record them at save and to verify them on resume.

A checkpoint-shaped directory (``--gib`` of safetensors shards of 256 MiB plus small JSON files, random bytes) is
written once; then, ``--repeats`` times each, the marker's checksums are computed (``checksum_files``, what a save
adds) and verified (``damaged_files``, what a resume adds), in one process and split across ``--ranks`` simulated
ranks (each share timed alone: the wall time of a real run is its slowest rank's share). The files are in the page
cache after the write, as they are right after a save; a cold resume also pays the disk's read speed.

    python benchmarks/checkpoint_integrity.py --gib 2 --repeats 5 --ranks 2

Results and the command: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from trlx_scale.reliability.checkpoint_integrity import checksum_files, damaged_files  # noqa: E402

SHARD = 256 * 2**20


def write_checkpoint(path: str, gib: float) -> int:
    total = int(gib * 2**30)
    written, index = 0, 0
    while written < total:
        size = min(SHARD, total - written)
        with open(os.path.join(path, f"model-{index:05d}.safetensors"), "wb") as handle:
            handle.write(os.urandom(size))
        written, index = written + size, index + 1
    for name in ("config.json", "trainer_state.json", "adapter_config.json"):
        with open(os.path.join(path, name), "w") as handle:
            json.dump({"name": name, "padding": "x" * 4000}, handle)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    cli = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=cli.dir) as path:
        size = write_checkpoint(path, cli.gib)
        gib = size / 2**30
        record, verify, split = [], [], []
        for _ in range(cli.repeats):
            start = time.perf_counter()
            files = checksum_files(path)
            record.append(time.perf_counter() - start)
            start = time.perf_counter()
            assert damaged_files(path, files) == []
            verify.append(time.perf_counter() - start)
            shares = []
            for rank in range(cli.ranks):
                start = time.perf_counter()
                checksum_files(path, rank, cli.ranks)
                shares.append(time.perf_counter() - start)
            split.append(max(shares))
        result = {
            "gib": round(gib, 3),
            "record_s_per_gib": round(statistics.median(record) / gib, 3),
            "verify_s_per_gib": round(statistics.median(verify) / gib, 3),
            f"record_s_per_gib_{cli.ranks}_ranks_slowest": round(statistics.median(split) / gib, 3),
            "record_s_runs": [round(t, 3) for t in record],
            "verify_s_runs": [round(t, 3) for t in verify],
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
