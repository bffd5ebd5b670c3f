"""A user's own run: `trlx-scale grpo|async_grpo|ppo|dpo` on a model, a local dataset and a reward the package did not
build trains with the config's defaults, as `trl grpo` does with the same flags (docs/defaults.md lists the only
fields that differ), on every training row."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

from .helpers.launch import REPO_ROOT, launch_env, read_run_summary
from .helpers.user_model import (
    USER_REWARD_MODULE,
    save_user_model,
    write_preference_jsonl,
    write_prompt_parquet,
)

TRLX_SCALE = os.path.join(os.path.dirname(sys.executable), "trlx-scale")
USER_ROWS = 24


def documented_differences() -> dict[str, set[str]]:
    """{command: fields} from docs/defaults.md's table "A user's run on the command line"."""
    with open(os.path.join(REPO_ROOT, "docs", "defaults.md")) as handle:
        text = handle.read()
    section = text.split("## A user's run on the command line", 1)[1].split("\n## ", 1)[0]
    differences: dict[str, set[str]] = {}
    for command, name in re.findall(r"^\| `(\w+)` \| `(\w+)` \|", section, flags=re.MULTILINE):
        differences.setdefault(command, set()).add(name)
    return differences


def trl_parse(command: str, flags: list[str]):
    """TRL's own parse of ``flags`` as `trl grpo` / `trl dpo` run it on a CPU machine, with the policy's loading
    arguments built as TRL's script builds them."""
    from trl import DatasetMixtureConfig, DPOConfig, GRPOConfig, ModelConfig, ScriptArguments, TrlParser
    from trl.scripts.grpo import GRPOScriptArguments

    classes = (ScriptArguments, DPOConfig) if command == "dpo" else (GRPOScriptArguments, GRPOConfig)
    parser = TrlParser((*classes, ModelConfig, DatasetMixtureConfig))
    _, config, model_args, _ = parser.parse_args_and_config([*flags, "--use_cpu", "true", "--bf16", "false"])
    config.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": config.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(config.model_init_kwargs or {}),
    }
    return config


def _user_inputs(tmp_path, command: str) -> tuple[str, str]:
    model = save_user_model(tmp_path / "my-model")
    if command == "dpo":
        return model, write_preference_jsonl(tmp_path / "pairs.jsonl", USER_ROWS)
    return model, write_prompt_parquet(tmp_path / "prompts.parquet", USER_ROWS)


def _run(command: list[str], cwd, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(launch_env(as_a_user=True), VLLM_CPU_KVCACHE_SPACE="1")
    result = subprocess.run(command, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


@pytest.mark.slow
@pytest.mark.parametrize("command", ["grpo", "async_grpo", "ppo", "dpo"])
def test_a_users_run_trains_with_the_configs_defaults(command, tmp_path):
    model, data = _user_inputs(tmp_path, command)
    (tmp_path / "user_rewards.py").write_text(USER_REWARD_MODULE)
    out = tmp_path / "run"
    # What a user sets to keep a first try short; the same flags go to TRL's parse.
    flags = ["--model_name_or_path", model, "--dataset_name", data, "--output_dir", str(out), "--max_steps", "2"]
    flags += ["--per_device_train_batch_size", "4", "--logging_steps", "1"]
    if command == "dpo":
        flags += ["--max_length", "48"]
    else:
        flags += ["--reward_funcs", "user_rewards.digit_reward", "--num_generations", "4"]
        flags += ["--max_completion_length", "8"]
    result = _run([TRLX_SCALE, command, *flags], cwd=tmp_path)

    trained = torch.load(out / "training_args.bin", weights_only=False)
    expected = trl_parse(command, flags)
    allowed = documented_differences().get(command, set())
    differing = {
        f.name: (getattr(trained, f.name), getattr(expected, f.name))
        for f in dataclasses.fields(expected)
        if f.name not in allowed and getattr(trained, f.name) != getattr(expected, f.name)
    }
    assert not differing, f"fields that differ from `trl {command}` and docs/defaults.md does not list: {differing}"
    for name in allowed:  # the table lists what differs, nothing more
        assert getattr(trained, name) != getattr(expected, name), name

    summary = read_run_summary(out)
    assert summary["steps"] == 2 and summary["train_rows"] == USER_ROWS  # no row held out
    assert summary["accuracy_before"] is None  # nothing asked to be held out, so nothing is scored
    if command != "dpo":
        assert "rewards/digit_reward/mean" in result.stdout  # the user's own reward scored the samples


def test_the_demos_settings_stay_with_the_embedded_task():
    from trlx_scale import GRPOConfig
    from trlx_scale.scripts import grpo
    from trlx_scale.tasks.example_runtime import ROLLOUT_EXAMPLE_DEFAULTS, parse_example_flags

    script_args, config, _, _ = parse_example_flags(grpo.EXAMPLE, [])
    assert config.max_completion_length == ROLLOUT_EXAMPLE_DEFAULTS["max_completion_length"]
    assert config.learning_rate == ROLLOUT_EXAMPLE_DEFAULTS["learning_rate"] and script_args.eval_size == 600
    script_args, config, model_args, _ = parse_example_flags(grpo.EXAMPLE, ["--dataset_name", "prompts.parquet"])
    plain = GRPOConfig(use_cpu=True, bf16=False)
    for name in ("max_completion_length", "learning_rate", "per_device_train_batch_size", "max_steps", "report_to"):
        assert getattr(config, name) == getattr(plain, name), name
    assert script_args.eval_size is None and not model_args.use_peft
    # A flag valid under the config's defaults is not refused for the demo's (which a first parse once applied).
    parse_example_flags(grpo.EXAMPLE, ["--dataset_name", "prompts.parquet", "--generation_batch_size", "8"])


def test_every_row_is_trained_on_unless_rows_are_held_out(tmp_path):
    from trl import DatasetMixtureConfig

    from trlx_scale.scripts import grpo
    from trlx_scale.tasks.example_runtime import load_prompt_task, parse_example_flags

    data = write_prompt_parquet(tmp_path / "prompts.parquet", 300)
    script_args, config, _, mixture = parse_example_flags(grpo.EXAMPLE, ["--dataset_name", data])
    task = load_prompt_task(script_args, config, mixture)
    assert len(task.train) == 300 and task.held_out is None and task.evaluation is None

    script_args, config, _, _ = parse_example_flags(
        grpo.EXAMPLE, ["--dataset_name", data, "--eval_size", "20", "--eval_strategy", "steps"]
    )
    task = load_prompt_task(script_args, config, DatasetMixtureConfig())
    assert (len(task.train), len(task.held_out), len(task.evaluation)) == (280, 20, 20)
    assert not {str(p) for p in task.train["prompt"]} & {str(p) for p in task.held_out["prompt"]}

    folder = tmp_path / "with_test"
    folder.mkdir()
    write_prompt_parquet(folder / "train.parquet", 300)
    write_prompt_parquet(folder / "test.parquet", 30)
    script_args, config, _, _ = parse_example_flags(grpo.EXAMPLE, ["--dataset_name", str(folder), "--eval_size", "10"])
    task = load_prompt_task(script_args, config)
    assert (len(task.train), len(task.held_out)) == (300, 10)  # the test split is held out, not training rows

    script_args, config, _, _ = parse_example_flags(grpo.EXAMPLE, ["--dataset_name", data, "--eval_strategy", "steps"])
    with pytest.raises(ValueError, match="--eval_strategy steps needs prompts to evaluate.*--eval_size N"):
        load_prompt_task(script_args, config)


def test_a_local_file_of_an_unknown_kind_is_refused_by_name(tmp_path):
    from trlx_scale.scripts import grpo
    from trlx_scale.tasks.example_runtime import load_prompt_task, parse_example_flags

    path = tmp_path / "prompts.txt"
    path.write_text("1+1=\n")
    script_args, config, _, _ = parse_example_flags(grpo.EXAMPLE, ["--dataset_name", str(path)])
    with pytest.raises(ValueError, match=r"--dataset_name .*prompts.txt: a local file must end in one of"):
        load_prompt_task(script_args, config)


def test_a_datasets_mixture_in_a_config_file_is_a_users_run(tmp_path):
    """TRL's `datasets:` mixture (a --config YAML), as `trl grpo` reads it: the run is the user's (the config's
    defaults, no demo settings) and trains on the mixture's rows."""
    from trlx_scale import GRPOConfig
    from trlx_scale.scripts import grpo
    from trlx_scale.tasks.example_runtime import load_prompt_task, parse_example_flags, trains_embedded_task

    data = write_prompt_parquet(tmp_path / "prompts.parquet", 30)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(f"datasets:\n  - path: parquet\n    data_files: {data}\n    split: train\n")
    script_args, config, _, mixture = parse_example_flags(grpo.EXAMPLE, ["--config", str(config_file)])
    assert trains_embedded_task(script_args, mixture) is False
    assert config.max_completion_length == GRPOConfig(use_cpu=True, bf16=False).max_completion_length
    task = load_prompt_task(script_args, config, mixture)
    assert len(task.train) == 30 and task.held_out is None
