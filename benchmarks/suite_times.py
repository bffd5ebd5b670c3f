"""Where the test suite's time goes: the per-file totals and the slowest tests of a `make test` run.

`make test` writes every test's time to outputs/test-times.xml (JUnit); this reads it:

    python benchmarks/suite_times.py [outputs/test-times.xml] [--top 30]
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ElementTree
from collections import defaultdict


def test_times(path: str) -> list[tuple[str, str, float]]:
    """(file, test name, seconds) of every test case in a JUnit report."""
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        cases.append((f"{module}.py", case.get("name", ""), float(case.get("time", 0.0))))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", nargs="?", default="outputs/test-times.xml")
    parser.add_argument("--top", type=int, default=30, help="How many files and tests to list.")
    args = parser.parse_args()
    cases = test_times(args.report)
    by_file: dict[str, list[float]] = defaultdict(list)
    for file, _, seconds in cases:
        by_file[file].append(seconds)
    total = sum(seconds for _, _, seconds in cases)
    print(f"{len(cases)} tests, {total / 60:.1f} min in tests (set-up and tear-down included)\n")
    print(f"{'minutes':>8} {'share':>6} {'tests':>5}  file")
    for file, times in sorted(by_file.items(), key=lambda item: -sum(item[1]))[: args.top]:
        print(f"{sum(times) / 60:8.2f} {sum(times) / total:6.1%} {len(times):5d}  {file}")
    print(f"\n{'seconds':>8}  test")
    for file, name, seconds in sorted(cases, key=lambda case: -case[2])[: args.top]:
        print(f"{seconds:8.1f}  {file}::{name}")


if __name__ == "__main__":
    main()
