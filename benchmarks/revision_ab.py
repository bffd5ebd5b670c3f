"""A benchmark of this checkout against another git revision, interleaved, medians of repeats.

A change that must leave speed unchanged (a restructure) is checked here: each repeat runs the benchmark on the base
revision (a temporary ``git worktree``) and on this checkout, in alternating order, with the same Python environment,
so the noise of the machine falls on both alike. The benchmark is any script of ``benchmarks/`` that writes ``--json-out``; the
numbers compared are the ``summary`` entries its JSON holds.

    python benchmarks/revision_ab.py --base f44fec1 --repeats 3 -- grpo_step.py --variants ours --repeats 1 --steps 4

prints, per summary entry, the median over the repeats for each revision and the median of the per-repeat ratios
(this checkout's over the base's: above 1 where the entry is a rate and this checkout is faster, below 1 where it is
a time and this checkout is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _numbers(summary: dict, prefix: str = "") -> dict[str, float]:
    """The summary's numbers, nested keys joined with '/'."""
    found: dict[str, float] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found.update(_numbers(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            found[name] = float(value)
    return found


def _run(checkout: str, script: str, arguments: list[str], out: str) -> dict[str, float]:
    command = [sys.executable, os.path.join(checkout, "benchmarks", script), *arguments, "--json-out", out]
    subprocess.run(command, check=True, cwd=checkout)
    with open(out) as handle:
        return _numbers(json.load(handle)["summary"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("benchmark", nargs=argparse.REMAINDER, help="-- SCRIPT [its arguments]")
    cli = parser.parse_args()
    benchmark = cli.benchmark[1:] if cli.benchmark[:1] == ["--"] else cli.benchmark
    if not benchmark:
        parser.error("name the benchmark after --, e.g. -- grpo_step.py --variants ours")
    script, arguments = benchmark[0], benchmark[1:]
    results: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
    with tempfile.TemporaryDirectory() as scratch:
        worktree = os.path.join(scratch, "base")
        subprocess.run(["git", "worktree", "add", "--detach", "-q", worktree, cli.base], check=True, cwd=REPO)
        try:
            for repeat in range(cli.repeats):
                order = [("base", worktree), ("head", REPO)]
                # Each revision runs first in every other repeat: what running second costs or gives (a warm page
                # cache, a machine still busy with the last run) falls on both alike.
                for name, checkout in order if repeat % 2 == 0 else order[::-1]:
                    numbers = _run(checkout, script, arguments, os.path.join(scratch, f"{name}-{repeat}.json"))
                    for key, value in numbers.items():
                        results[name].setdefault(key, []).append(value)
                    print(f"repeat {repeat} {name}: {numbers}", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", worktree], check=False, cwd=REPO)
    print(f"{script} {' '.join(arguments)}: base {cli.base} against this checkout, medians of {cli.repeats}")
    print("| summary entry | base (median) | this checkout (median) | this / base: median of the per-repeat ratios |")
    print("|---|---|---|---|")
    for key in sorted(results["head"]):
        if key not in results["base"]:
            continue
        pairs = list(zip(results["base"][key], results["head"][key], strict=True))
        ratios = [head / base for base, head in pairs if base]
        ratio = f"{statistics.median(ratios):.3f} ({', '.join(f'{r:.3f}' for r in ratios)})" if ratios else "-"
        base, head = statistics.median(results["base"][key]), statistics.median(results["head"][key])
        print(f"| {key} | {base:.4g} | {head:.4g} | {ratio} |")


if __name__ == "__main__":
    main()
