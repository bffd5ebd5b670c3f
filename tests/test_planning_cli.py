"""`trlx-scale plan` end to end: the tables, --json, --write (a config Accelerate loads), and errors naming the flag."""

import json
import os
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from trlx_scale.cli import main as cli_main

from .helpers.models import tiny_llama_config

SEVEN_B = ["--params", "6.74e9", "--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "32000"]


def test_table_lists_every_backend_and_a_recommendation(capsys):
    assert (
        cli_main(["plan", *SEVEN_B, "--algo", "grpo", "--lora-rank", "16", "--gpus-per-node", "1", "--gpu", "a100-80"])
        == 0
    )
    out = capsys.readouterr().out
    for backend in ("ddp on", "zero2 on", "zero3 on", "fsdp2 on"):
        assert backend in out
    assert "FITS" in out and "recommendation: ddp on 1 x 1 GPU(s)" in out
    assert "vLLM engine (sleep level 1)" in out and "policy adapter optimizer" in out


def test_the_plan_says_what_it_assumes_of_the_engine_in_the_configs_words(capsys):
    """The plan counts the engine's memory as freed during training only when sleep mode is on, which the trainer's
    config leaves off by default: the plan says which it assumed and how to get it."""
    base = ["plan", *SEVEN_B, "--algo", "grpo", "--gpus-per-node", "1", "--gpu", "a100-80"]
    assert cli_main([*base, "--lora-rank", "16"]) == 0
    assert "assumes: vllm_enable_sleep_mode=True, vllm_sleep_level=1 (" in capsys.readouterr().out
    assert cli_main(base) == 0  # full fine-tuning: level 2 (weights discarded and re-sent)
    assert "assumes: vllm_enable_sleep_mode=True, vllm_sleep_level=2 (" in capsys.readouterr().out
    assert cli_main([*base, "--no-sleep"]) == 0
    assert "assumes: vllm_enable_sleep_mode=False (" in capsys.readouterr().out
    assert cli_main([*base, "--no-vllm"]) == 0
    assert "assumes: no vLLM engine in the training processes" in capsys.readouterr().out


def test_json_has_fits_peak_and_roles_per_backend(capsys):
    args = ["plan", *SEVEN_B, "--algo", "ppo", "--gpus-per-node", "8", "--gpu", "h100", "--backend", "zero3"]
    assert cli_main([*args, "--backend", "ddp", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["backends"]) == {"zero3", "ddp"}
    for entry in result["backends"].values():
        assert isinstance(entry["fits"], bool) and entry["per_gpu_gib"] > 0
        assert "reference" in entry["roles"]
        peak = max(entry["training_phase_gib"], entry["generation_phase_gib"])
        assert entry["per_gpu_gib"] == pytest.approx(peak, abs=1e-3)
    assert "critic (separate)" in result["backends"]["ddp"]["roles"]  # a replica under DDP
    assert "critic (separate, sharded)" in result["backends"]["zero3"]["roles"]  # its own engine under ZeRO-3
    assert result["model"]["params"] == 6_740_000_000
    assert result["disaggregated_split"]["generation_gpus"] + result["disaggregated_split"]["training_gpus"] == 8


def test_the_token_budget_lowers_the_activations_it_bounds(capsys):
    """7B GRPO, 16 sequences x 8192 tokens, checkpointed: packed forwards of 16384 tokens recompute one layer for
    16384 tokens instead of 131072 (the kept activations and logits unchanged)."""
    args = ["plan", *SEVEN_B, "--algo", "grpo", "--gpus-per-node", "8", "--gpu", "h100", "--backend", "zero3"]
    args += ["--micro-batch", "16", "--prompt-length", "192", "--completion-length", "8000", "--json"]
    activations = []
    for extra in ([], ["--max-tokens-per-microbatch", "16384"]):
        assert cli_main([*args, *extra]) == 0
        activations.append(json.loads(capsys.readouterr().out)["backends"]["zero3"]["roles"]["activations"])
    per_token_layer = 4 * 4096 + 2 * 4096 + 2 * 4096 + 4 * 11008  # 7B: a = k = 32 heads of 128, MLP 11008
    saved_gib = (131072 - 16384) * per_token_layer * 2 / 2**30
    assert activations[0]["training_gib"] - activations[1]["training_gib"] == pytest.approx(
        saved_gib, abs=0.01
    )  # JSON: 2 decimals


def test_write_produces_a_config_accelerate_loads_and_the_launch_command(tmp_path, capsys):
    args = ["plan", *SEVEN_B, "--algo", "grpo", "--gpus-per-node", "8", "--gpu", "a100-80", "--write", str(tmp_path)]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    (config_path,) = [p for p in tmp_path.iterdir() if p.suffix == ".yaml"]
    config = load_config_from_file(str(config_path))
    assert config.num_processes in (1, 2, 4, 8) and config.mixed_precision == "bf16"
    launch = (tmp_path / "launch.sh").read_text()
    assert f"trlx-scale grpo --accelerate_config {config_path}" in launch and "--use_peft false" in launch
    assert os.access(tmp_path / "launch.sh", os.X_OK) and "wrote" in out
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # written atomically


def test_zero2_config_loads_through_accelerate(tmp_path):
    args = ["plan", *SEVEN_B, "--algo", "grpo", "--lora-rank", "16", "--gpus-per-node", "2", "--gpu", "a100-80"]
    assert cli_main([*args, "--backend", "zero2", "--write", str(tmp_path), "--json"]) == 0
    (config_path,) = list(tmp_path.glob("*.yaml"))
    config = load_config_from_file(str(config_path))
    assert config.distributed_type == "DEEPSPEED" and config.deepspeed_config["zero_stage"] == 2


def test_model_read_from_a_local_directory(tmp_path, capsys):
    tiny_llama_config().save_pretrained(tmp_path)
    assert cli_main(["plan", "--model", str(tmp_path), "--gpu", "h200", "--gpus-per-node", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["params"] == 86848


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--gpu", "tpu-v9", *SEVEN_B], "--gpu-memory-gb"),
        (["--gpu", "h100", "--gpus-per-node", "8", "--vllm-tp", "3", *SEVEN_B], "--vllm-tp"),
        (["--gpu", "h100", "--layers", "32"], "--hidden"),
        (["--gpu", "h100", "--model", "/nonexistent/dir/without/config"], "--model"),
    ],
)
def test_bad_inputs_exit_2_with_the_flag_named(args, flag, capsys):
    assert cli_main(["plan", *args]) == 2
    assert flag in capsys.readouterr().err


def test_model_directory_without_config(tmp_path, capsys):
    assert cli_main(["plan", "--gpu", "h100", "--model", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["accelerate-config", "--help"]])
def test_console_script_is_fast_and_quiet(argv):
    """`trlx-scale` imports what a subcommand needs only when it runs: the CLI and the planner load no torch, TRL or
    vLLM (so --help answers at once), and nothing prints a warning."""
    script = os.path.join(os.path.dirname(sys.executable), "trlx-scale")
    result = subprocess.run([script, *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "usage: trlx-scale" in result.stdout
    assert result.stderr == ""
    probe = (
        "import sys, trlx_scale.cli as cli; cli.build_parser(); "
        "print(*[name in sys.modules for name in ('torch', 'trl', 'vllm', 'transformers')])"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert loaded.stdout.split() == ["False"] * 4, loaded.stdout + loaded.stderr
