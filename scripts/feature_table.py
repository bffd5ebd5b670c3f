"""The README's "What runs where" table, drawn from docs/feature_matrix.json (the evidence: a CI test per cell, or a
line of a GPU run's log under benchmarks/device_runs/).

    python scripts/feature_table.py            # print the table
    python scripts/feature_table.py --write    # replace the table in README.md between its markers

tests/test_feature_table.py checks every cell's evidence and that README.md shows the table as drawn."""

from __future__ import annotations

import argparse
import json
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATRIX = os.path.join(REPO_ROOT, "docs", "feature_matrix.json")
README = os.path.join(REPO_ROOT, "README.md")
START, END = "<!-- feature-table:start -->", "<!-- feature-table:end -->"
HEADERS = {
    "cpu": "CPU, 1 process",
    "ddp": "DDP, 2 CPU processes",
    "zero3": "ZeRO-3, 2 CPU processes",
    "fsdp2": "FSDP2, CPU",
    "gpu": "GPU",
}


def load_matrix(path: str = MATRIX) -> dict:
    with open(path) as handle:
        return json.load(handle)


def cell(column: str, value) -> str:
    """'CI' (a test in CI), the card and date of a GPU run, or 'never run'."""
    if value is None:
        return "never run"
    if column == "gpu":
        return f"ran: {value['card']}, {value['date']}"
    return "CI"


def render(matrix: dict) -> str:
    columns = matrix["columns"]
    lines = [
        "| feature | trainer | " + " | ".join(HEADERS[c] for c in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for row in matrix["rows"]:
        cells = " | ".join(cell(c, row.get(c)) for c in columns)
        lines.append(f"| {row['feature']} | {row['trainer']} | {cells} |")
    return "\n".join(lines)


def readme_with_table(readme: str, table: str) -> str:
    before, rest = readme.split(START, 1)
    _, after = rest.split(END, 1)
    return f"{before}{START}\n{table}\n{END}{after}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="replace the table in README.md")
    args = parser.parse_args()
    table = render(load_matrix())
    if not args.write:
        print(table)
        return
    with open(README) as handle:
        readme = handle.read()
    with open(README, "w") as handle:
        handle.write(readme_with_table(readme, table))


if __name__ == "__main__":
    main()
