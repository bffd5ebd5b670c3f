"""What tests/conftest.py sets for the suite: torch.compile off in the processes the suite launches, on in the pytest
process itself and in a run launched as a user's (``as_a_user=True``)."""

from __future__ import annotations

import subprocess
import sys

from .helpers.launch import launch_env

READ_TORCH_COMPILE_SWITCH = "import torch._dynamo.config as config; print(config.disable)"


def _child_compile_disabled(env: dict) -> bool:
    result = subprocess.run(
        [sys.executable, "-c", READ_TORCH_COMPILE_SWITCH], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip() == "True"


def test_launched_processes_run_without_torch_compile_and_this_one_and_a_users_with_it():
    import torch._dynamo.config

    assert torch._dynamo.config.disable is False  # flex_attention on CPU, tested in this process, needs it
    assert _child_compile_disabled(launch_env())
    assert not _child_compile_disabled(launch_env(as_a_user=True))
