"""The README's "What runs where" table: each cell's evidence holds (a CI cell names a test that exists outside
tests/gpu/ and is not skipped; a GPU cell quotes a line its run's log holds), and README.md shows the table as
scripts/feature_table.py draws it from docs/feature_matrix.json."""

from __future__ import annotations

import ast
import importlib.util
import os

from .helpers.launch import REPO_ROOT


def _feature_table():
    spec = importlib.util.spec_from_file_location(
        "feature_table", os.path.join(REPO_ROOT, "scripts", "feature_table.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _test_functions(path: str) -> dict[str, ast.FunctionDef]:
    with open(path) as handle:
        tree = ast.parse(handle.read())
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def _is_skipped(function: ast.FunctionDef, path: str) -> bool:
    """A skip or skipif marker on the function, or in the module's ``pytestmark``."""
    markers = [ast.unparse(decorator) for decorator in function.decorator_list]
    with open(path) as handle:
        tree = ast.parse(handle.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            markers.append(ast.unparse(node.value))
    return any("skip" in marker for marker in markers)


def test_every_ci_cell_names_a_test_that_runs_in_ci():
    matrix = _feature_table().load_matrix()
    ci_columns = [column for column in matrix["columns"] if column != "gpu"]
    cited = 0
    for row in matrix["rows"]:
        for column in ci_columns:
            reference = row.get(column)
            if reference is None:
                continue
            path, name = reference.split("::")
            assert path.startswith("tests/") and not path.startswith("tests/gpu/"), (row, column)
            full = os.path.join(REPO_ROOT, path)
            functions = _test_functions(full)
            assert name in functions and name.startswith("test_"), f"{reference} does not exist ({row['feature']})"
            assert not _is_skipped(functions[name], full), f"{reference} is skipped: its cell cannot say CI"
            cited += 1
    assert cited >= len(matrix["rows"])  # at least a cell per row on average: the table is evidence, not a wish


def test_every_gpu_cell_quotes_its_runs_log():
    matrix = _feature_table().load_matrix()
    for row in matrix["rows"]:
        run = row.get("gpu")
        if run is None:
            continue
        assert run["log"].startswith("benchmarks/device_runs/"), row
        with open(os.path.join(REPO_ROOT, run["log"])) as handle:
            lines = handle.read().splitlines()
        assert run["line"] in lines, f"{run['log']} holds no line {run['line']!r} ({row['feature']})"
        assert run["card"] in ("H100", "H200") and len(run["date"]) == 10, row


def test_the_readme_shows_the_table_as_drawn():
    table = _feature_table()
    with open(os.path.join(REPO_ROOT, "README.md")) as handle:
        readme = handle.read()
    assert table.render(table.load_matrix()) in readme, (
        "README.md's table is stale: run scripts/feature_table.py --write"
    )
