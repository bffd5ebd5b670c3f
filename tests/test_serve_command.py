"""`trlx-scale serve`: the server command it builds (the running server itself: tests/engine/test_vllm_server.py)."""

from __future__ import annotations

import subprocess
import sys


def _dry_run(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "trlx_scale.cli", "serve", *args, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_serve_sets_up_what_the_async_trainer_needs():
    command = _dry_run("my-org/model", "--port", "8123", "--max-staleness", "3", "--devices", "4,5")
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in command and "VLLM_SERVER_DEV_MODE=1" in command
    assert "CUDA_VISIBLE_DEVICES=4,5" in command
    assert "--port 8123" in command and "--logprobs-mode processed_logprobs" in command
    assert "--enable-lora --max-loras 5" in command  # max_staleness + 2 adapter slots
    assert "--enable-prefix-caching" in command


def test_serve_defaults_to_the_embedded_model_in_float32_on_cpu():
    command = _dry_run()
    assert "embedded_model" in command and "--dtype float32" in command


def test_serve_passes_flags_after_the_double_dash_to_vllm():
    result = subprocess.run(
        [sys.executable, "-m", "trlx_scale.cli", "serve", "m", "--dry-run", "--no-lora", "--", "--enforce-eager"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("--enforce-eager") and "--enable-lora" not in result.stdout
