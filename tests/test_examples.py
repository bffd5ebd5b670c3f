"""examples/grpo.py end to end: one process, two processes through `accelerate launch`, and real learning."""

import os
import re

import pytest

from .helpers.examples import example_help, example_module
from .helpers.launch import ACCELERATE, ACCELERATE_LAUNCH, REPO_ROOT, read_run_summary, run_command

EXAMPLE = os.path.join(REPO_ROOT, "examples", "grpo.py")


def test_help_lists_config_fields_as_flags(capsys):
    printed = example_help("grpo", capsys)
    for flag in ("--vllm_dtype", "--vllm_cpu_kvcache_space", "--num_generations", "--use_peft", "--answer_column"):
        assert flag in printed, flag


@pytest.mark.slow
def test_example_single_process_saves_adapter_and_summary(grpo_example_three_steps):
    out, printed = grpo_example_three_steps
    assert "held-out acc." in printed
    summary = read_run_summary(out)
    assert summary["steps"] == 3 and summary["world_size"] == 1
    # Saved through the standard Trainer path: the LoRA adapter and a model card.
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert "trlx-scale" in (out / "README.md").read_text()


@pytest.mark.slow
def test_example_two_processes_through_accelerate_launch(tmp_path):
    """DDP on CPU (gloo), one vLLM engine per process, LoRA with fp32 masters (bf16 model) under DDP."""
    out = tmp_path / "run2"
    config = os.path.join(REPO_ROOT, "configs", "accelerate", "cpu_ddp.yaml")
    result = run_command(
        [ACCELERATE, "launch", "--config_file", config, "--num_processes", "2", EXAMPLE]
        + ["--max_steps", "3", "--eval_size", "40", "--output_dir", str(out), "--optim_preset", "grpo_lora"],
        timeout=800,
    )
    summary = read_run_summary(out)
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert (
        "optimizer preset 'grpo_lora'" in result.stdout and "fp32_master_weights: model held in bf16" in result.stdout
    )


# What one sync sends for the default model in fp32: rank-64 adapters on the 7 projections of 3 layers, or every
# weight of the model (tied embeddings counted once).
ADAPTER_BYTES = 4 * 3 * 64 * (4 * (128 + 128) + 2 * (128 + 512) + (512 + 128))
MODEL_BYTES = 4 * (261 * 128 + 3 * (4 * 128 * 128 + 3 * 128 * 512 + 2 * 128) + 128)


@pytest.mark.slow
@pytest.mark.parametrize(("use_peft", "expected_bytes"), [("true", ADAPTER_BYTES), ("false", MODEL_BYTES)])
def test_example_under_deepspeed_zero3_syncs_gathered_weights(tmp_path, use_peft, expected_bytes):
    """ZeRO-3 really shards on CPU with gloo. LoRA-only sync gathers just the adapter; full sync gathers bucket by
    bucket and sends every weight; either way vLLM stays in sync with the sharded policy."""
    out = tmp_path / "zero3"
    config = os.path.join(REPO_ROOT, "configs", "accelerate", "cpu_zero3.yaml")
    run_command(
        [*ACCELERATE_LAUNCH, "--config_file", config, EXAMPLE]
        + ["--max_steps", "2", "--eval_size", "40", "--output_dir", str(out), "--logging_steps", "1"]
        + ["--use_peft", use_peft, "--learning_rate", "1e-4", "--vllm_sync_bucket_mb", "1"]
        + ["--vllm_sync_mode", "lora" if use_peft == "true" else "auto"],
        timeout=800,
    )
    summary = read_run_summary(out)
    assert summary["world_size"] == 2 and summary["steps"] == 2
    assert summary["sync_logprob_gap_max"] < 1e-3
    assert summary["sync_bytes_last"] == expected_bytes


@pytest.mark.slow
def test_default_run_improves_held_out_accuracy_as_much_as_the_readme_claims(tmp_path):
    """The README's main job, as `make run` launches it: held-out accuracy must rise at least by the floor the README
    states, the README's printed summary must be above that floor too, and the run records an accuracy curve."""
    out = tmp_path / "learn"
    command = [*ACCELERATE_LAUNCH, "--num_processes", "1", EXAMPLE, "--output_dir", str(out)]
    result = run_command(command, timeout=800, as_a_user=True)
    summary = read_run_summary(out)
    gain = 100 * (summary["accuracy_after"] - summary["accuracy_before"])
    with open(os.path.join(REPO_ROOT, "README.md")) as handle:
        readme = handle.read()
    floor = float(re.search(r"fails if the gain falls below \+([0-9.]+) points", readme).group(1))
    printed = float(re.search(r"^gain +\+([0-9.]+) points$", readme, re.M).group(1))
    assert printed >= floor, "the README's own summary is below the floor it states"
    assert gain >= floor, f"held-out gain {gain:+.1f} points < the README's floor +{floor}\n{result.stdout[-2000:]}"
    assert f"gain             {gain:+.1f} points" in result.stdout
    # The curve: before, every 50 steps, after.
    steps = [step for step, _ in summary["accuracy_curve"]]
    assert steps == [0, 50, 100, 150, 200], steps
    assert summary["accuracy_curve"][-1][1] == summary["accuracy_after"]


@pytest.mark.parametrize("name", ["grpo", "ppo", "dpo"])
def test_preset_in_a_config_file_replaces_the_example_optimizer_defaults(name, tmp_path):
    """--optim_preset set in a --config YAML (not on the command line) wins over the example's own learning rate."""
    from trlx_scale.tasks.example_runtime import parse_example_flags

    example = example_module(name).EXAMPLE
    _, plain, _, _ = parse_example_flags(example, [])
    config_file = tmp_path / "run.yaml"
    config_file.write_text("optim_preset: dpo\n" if name == "dpo" else "optim_preset: grpo_lora\n")
    _, preset, _, _ = parse_example_flags(example, ["--config", str(config_file)])
    expected = 5e-7 if name == "dpo" else 1e-5
    assert plain.learning_rate != expected and preset.learning_rate == expected
    assert preset.warmup_steps in (20, 50)  # the preset's warmup, not the example's 5


@pytest.mark.parametrize("name", ["grpo", "ppo", "dpo"])
def test_every_example_honours_the_same_shared_flags(name, tmp_path):
    from trlx_scale.tasks.example_runtime import SHARED_EXAMPLE_DEFAULTS, parse_example_flags

    example = example_module(name).EXAMPLE
    _, config, model_args, _ = parse_example_flags(example, ["--dtype", "bfloat16", "--lora_r", "8"])
    assert model_args.dtype == "bfloat16" and model_args.lora_r == 8
    assert config.vllm_dtype == SHARED_EXAMPLE_DEFAULTS["vllm_dtype"] and config.seed == 42


def test_dpo_online_defaults_follow_a_config_file(tmp_path):
    from trlx_scale.tasks.example_runtime import parse_example_flags

    module = example_module("dpo")
    config_file = tmp_path / "online.yaml"
    config_file.write_text("online: true\n")
    _, config, _, _ = parse_example_flags(module.EXAMPLE, ["--config", str(config_file)])
    assert config.online and config.learning_rate == module.EXAMPLE_LEARNING_RATE["online"]
    assert config.output_dir.endswith("dpo-addition-online")
