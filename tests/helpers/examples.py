"""The example scripts (examples/*.py) as modules of this process, for what needs no run of their own."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import pytest

from .launch import REPO_ROOT


def example_module(name: str) -> ModuleType:
    """examples/<name>.py imported as the module ``example_<name>``."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(REPO_ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module while the file executes
    spec.loader.exec_module(module)
    return module


def example_help(name: str, capsys) -> str:
    """What ``python examples/<name>.py --help`` prints: the example's own main() with ``--help``, here (a separate
    process would spend its 10-20 s importing torch, TRL and vLLM again; every launched run goes through the same
    main())."""
    module = example_module(name)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code in (0, None), exit_info.value.code
    return capsys.readouterr().out
