"""examples/ppo.py end to end through `accelerate launch`: PPO with the colocated engine raises held-out accuracy."""

import os

import pytest

from .helpers.examples import example_help
from .helpers.launch import ACCELERATE_LAUNCH, REPO_ROOT, read_run_summary, run_command

EXAMPLE = os.path.join(REPO_ROOT, "examples", "ppo.py")


def test_help_lists_config_fields_as_flags(capsys):
    printed = example_help("ppo", capsys)
    for flag in ("--critic_mode", "--kl_coef", "--lam", "--cliprange_value", "--target_kl", "--num_iterations"):
        assert flag in printed, flag


@pytest.mark.slow
def test_ppo_example_improves_held_out_accuracy(tmp_path):
    out = tmp_path / "ppo"
    run_command([*ACCELERATE_LAUNCH, "--num_processes", "1", EXAMPLE, "--output_dir", str(out)], timeout=800)
    summary = read_run_summary(out)
    gain = summary["accuracy_after"] - summary["accuracy_before"]
    assert gain >= 0.03, summary  # measured on 300 held-out: +11.3 points (docs/benchmarks.md)
    assert (out / "adapter_model.safetensors").is_file() and "trlx-scale" in (out / "README.md").read_text()
