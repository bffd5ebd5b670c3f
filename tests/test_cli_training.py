"""`trlx-scale grpo|ppo|dpo` as TRL users run `trl grpo`, the shipped recipes, and the package as its wheel installs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv

import pytest

from trlx_scale.launch_training import accelerate_config_path, shipped_accelerate_configs, split_arguments
from trlx_scale.recipe_check import check_recipe
from trlx_scale.recipes import load_recipe, recipe_names

from .helpers.launch import REPO_ROOT, launch_env, read_run_summary

TRLX_SCALE = os.path.join(os.path.dirname(sys.executable), "trlx-scale")
# The recipes the issue asks for, by what they train on which hardware.
EXPECTED_RECIPES = {
    "grpo-lora-1.5b-math-1xh100",
    "grpo-full-7b-8xh100-fsdp2",
    "gspo-moe-30b-a3b-8xh100",
    "dpo-full-8b-8xh100-zero3",
    "ppo-lora-70b-8x8xh100-zero3",
}


def _run(command: list[str], cwd: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env or launch_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


# ---------------------------------------------------------------------------------------------- arguments


def test_accelerate_configs_ship_in_the_package_and_resolve_by_name():
    names = shipped_accelerate_configs()
    assert {
        "single_gpu",
        "ddp",
        "fsdp2",
        "zero3",
        "multinode_zero3",
        "multinode_fsdp2",
        "cpu_ddp",
        "cpu_zero3",
    } <= set(names)
    assert accelerate_config_path("zero3").endswith(os.path.join("trlx_scale", "accelerate_configs", "zero3.yaml"))
    # configs/accelerate/ of a source checkout is the same folder.
    assert os.path.samefile(
        accelerate_config_path("cpu_ddp"), os.path.join(REPO_ROOT, "configs", "accelerate", "cpu_ddp.yaml")
    )
    with pytest.raises(ValueError, match="neither a file nor a config shipped with trlx_scale; give a path or one of"):
        accelerate_config_path("zero9")


def test_script_flags_go_to_the_script_and_the_rest_to_accelerate_launch():
    launch, script = split_arguments(
        "grpo",
        [
            "--max_steps",
            "2",
            "--accelerate_config",
            "cpu_ddp",
            "--num_processes",
            "2",
            "--reward_funcs",
            "exact_match",
        ],
    )
    assert launch[:2] == ["--config_file", accelerate_config_path("cpu_ddp")] and launch[2:] == [
        "--num_processes",
        "2",
    ]
    assert script == ["--max_steps", "2", "--reward_funcs", "exact_match"]
    # Without a config: one process, as `make run`; several: data parallel.
    launch, _ = split_arguments("ppo", ["--kl_coef", "0.1"])
    assert launch == [
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
    launch, _ = split_arguments("dpo", ["--num_processes", "2", "--online"])
    assert launch[0] == "--multi_gpu" and launch[1:3] == ["--num_processes", "2"]
    # --flag=value counts as --flag value; a launcher mode of the user's is kept alone (Accelerate refuses two).
    launch, script = split_arguments("grpo", ["--num_processes=2", "--use_deepspeed", "--max_steps=3"])
    assert launch.count("--num_processes") == 1 and "--multi_gpu" not in launch and script == ["--max_steps", "3"]
    launch, _ = split_arguments("grpo", ["--accelerate_config=cpu_zero3"])
    assert launch == ["--config_file", accelerate_config_path("cpu_zero3")]
    # A recipe brings its Accelerate config when no launch argument is given.
    launch, script = split_arguments("grpo", ["--recipe", "grpo-full-7b-8xh100-fsdp2"])
    assert launch == ["--config_file", accelerate_config_path("fsdp2")] and script[0] == "--recipe"


def test_bad_reward_names_and_bad_configs_get_clear_errors(tmp_path):
    from trlx_scale.tasks.reward_functions import resolve_reward_functions

    with pytest.raises(ValueError, match="'accuracy' is not a known reward: use one of"):
        resolve_reward_functions(["accuracy"], "answer")
    with pytest.raises(ValueError, match="--reward_funcs nowhere.reward: cannot import it"):
        resolve_reward_functions(["nowhere.reward"], "answer")
    result = subprocess.run(
        [TRLX_SCALE, "grpo", "--accelerate_config", "zero9"], capture_output=True, text=True, env=launch_env()
    )
    assert result.returncode == 2 and "--accelerate_config zero9: neither a file nor a config" in result.stderr


# ---------------------------------------------------------------------------------------------- recipes


def test_every_recipe_parses_into_its_config_and_fits_on_its_hardware():
    assert EXPECTED_RECIPES <= set(recipe_names())
    for name in recipe_names():
        recipe = load_recipe(name)
        check = check_recipe(recipe, cpu_only=True)
        assert not check.problems(), (name, check.problems())
        assert check.plan.fits and check.planned_gib < check.plan.gpu_memory_gib
        for key in ("description", "hardware", "dataset_columns", "accelerate_config"):
            assert recipe.meta[key], (name, key)
        assert recipe.meta["accelerate_config"] in shipped_accelerate_configs()


def test_a_stale_memory_statement_is_caught(tmp_path):
    recipe = load_recipe("grpo-lora-1.5b-math-1xh100")
    recipe.meta["expected_gib_per_gpu"] = 5.0
    assert any("update expected_gib_per_gpu" in p for p in check_recipe(recipe).problems())
    recipe.meta["hardware"] = {"gpu": "a10g", "nodes": 1, "gpus_per_node": 1}
    assert any("does not fit" in p for p in check_recipe(recipe).problems())


def test_every_recipe_evaluates_reports_and_declares_its_extras():
    """Each recipe evaluates with the run's reward (held-out prompts or the test split) and reports to a tracker;
    the extras it needs are declared in the recipe and exist in pyproject.toml."""
    import tomllib

    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as handle:
        extras = set(tomllib.load(handle)["project"]["optional-dependencies"])
    for name in recipe_names():
        recipe = load_recipe(name)
        config = recipe.config
        assert config.get("eval_strategy") == "steps" and config.get("eval_steps"), name
        assert config.get("eval_size") or config.get("dataset_test_split"), name
        assert config.get("report_to") not in (None, "none"), name
        declared = set(recipe.meta["extras"])
        assert declared <= extras, (name, declared - extras)
        if "accuracy_reward" in config.get("reward_funcs", []):
            assert "math" in declared, name  # accuracy_reward verifies with math-verify
        if recipe.meta["accelerate_config"].startswith(("zero", "multinode_zero")):
            assert "deepspeed" in declared, name
        assert recipe.meta["model_type"] in ("qwen2", "qwen3_moe", "llama"), name


def _shrunk_recipe_run(recipe_name: str, tmp_path) -> list[str]:
    """The recipe on a 2-layer model of its own architecture and a local dataset of its columns, cut to a 2-step,
    one-process CPU run that evaluates at step 2."""
    from .helpers.user_model import save_shrunk_model, write_math_folder, write_preference_folder

    recipe = load_recipe(recipe_name)
    model = save_shrunk_model(tmp_path / "model", recipe.meta["model_type"])
    out = tmp_path / "run"
    flags = ["--recipe", recipe_name, "--model_name_or_path", model, "--max_steps", "2", "--eval_steps", "2"]
    flags += ["--output_dir", str(out), "--logging_steps", "1", "--num_processes", "1", "--report_to", "none"]
    flags += ["--bf16", "false", "--dtype", "float32", "--save_strategy", "no"]
    if recipe.command == "dpo":
        flags += ["--dataset_name", write_preference_folder(tmp_path / "pairs", 16, 4)]
        flags += ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--max_length", "64"]
        flags += ["--vllm_ref_log_probs", "false"]
    else:
        flags += ["--dataset_name", write_math_folder(tmp_path / "math", 40), "--eval_size", "4"]
        flags += ["--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "6"]
        flags += ["--per_device_eval_batch_size", "4", "--gradient_accumulation_steps", "1"]
        flags += ["--vllm_tensor_parallel_size", "1"]
    return [recipe.command, *flags]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED_RECIPES))
def test_recipe_runs_two_steps_on_a_shrunk_model_of_its_architecture(name, tmp_path):
    out = tmp_path / "run"
    _run([TRLX_SCALE, *_shrunk_recipe_run(name, tmp_path)], cwd=str(tmp_path), timeout=900)
    summary = read_run_summary(out)
    assert summary["steps"] == 2
    with open(out / "trainer_state.json") as handle:
        history = json.load(handle)["log_history"]
    metric = "eval_loss" if load_recipe(name).command == "dpo" else "eval_reward"
    assert [entry["step"] for entry in history if metric in entry] == [2], history  # evaluated at step 2


# ---------------------------------------------------------------------------------------------- TRL's command line


def _math_dataset(folder) -> str:
    """A local stand-in for trl-lib/DeepMath-103K: 'prompt' (chat messages) and 'solution' columns."""
    folder.mkdir()
    with open(folder / "train.jsonl", "w") as handle:
        for a in range(10, 42):
            for b in (3, 7):
                row = {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "solution": f"${a + b}$"}
                handle.write(json.dumps(row) + "\n")
    return str(folder)


@pytest.mark.slow
def test_trl_documented_command_runs_with_trl_replaced_by_trlx_scale(tmp_path):
    """TRL's documented example, `trl grpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name
    trl-lib/DeepMath-103K --reward_funcs accuracy_reward --accelerate_config zero3`, with `trl` replaced by
    `trlx-scale`, the model and dataset swapped for local ones, and zero3 for its 2-process CPU twin."""
    from trlx_scale.tasks.default_model import default_model_path

    out = tmp_path / "run"
    command = [TRLX_SCALE, "grpo", "--model_name_or_path", default_model_path()]
    command += ["--dataset_name", _math_dataset(tmp_path / "deepmath"), "--reward_funcs", "accuracy_reward"]
    command += ["--accelerate_config", "cpu_zero3", "--main_process_port", "29641"]
    command += ["--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4"]
    command += ["--max_completion_length", "6", "--output_dir", str(out), "--logging_steps", "1"]
    result = _run(command, cwd=str(tmp_path), timeout=800)
    summary = read_run_summary(out)
    assert summary["steps"] == 2 and summary["world_size"] == 2
    assert "rewards/accuracy_reward/mean" in result.stdout  # TRL's own reward function scored the samples
    assert summary["accuracy_before"] is None  # no answer column: trained, not evaluated


# ---------------------------------------------------------------------------------------------- the wheel


@pytest.mark.slow
def test_the_built_wheel_works_from_outside_the_source_tree(tmp_path):
    """Build the wheel from a copy of the source tree, install it into a fresh virtual environment, give that
    environment this one's CPU stack (its site-packages, after the wheel's), and use it from another directory:
    `--help`, `plan`, a recipe check, and a 2-step `trlx-scale grpo`. A file missing from the package fails here."""
    import shutil
    import sysconfig

    source = tmp_path / "source"
    ignored = shutil.ignore_patterns(".venv", ".git", "outputs", "build", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(REPO_ROOT, source, ignore=ignored, symlinks=True)  # the build writes into its tree, not ours
    wheels = tmp_path / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheels), str(source)],
        str(tmp_path),
        600,
    )
    (wheel,) = wheels.glob("trlx_scale-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = str(env_dir / "bin" / "python")
    # Installed before the dependencies are visible: pip then sees no other trlx_scale to replace.
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", str(wheel)], str(tmp_path), 600)
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    # A path in a .pth file joins sys.path after the venv's own site-packages; the folder's own .pth files (this
    # environment's editable trlx_scale) are not run.
    with open(os.path.join(site, "cpu_stack.pth"), "w") as handle:
        handle.write(sysconfig.get_paths()["purelib"] + "\n")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = dict(launch_env(as_a_user=True), PATH=f"{env_dir / 'bin'}:{os.environ['PATH']}", PYTHONNOUSERSITE="1")
    located = _run([python, "-c", "import trlx_scale; print(trlx_scale.__file__)"], str(outside), 120, env)
    assert located.stdout.strip().startswith(site), located.stdout
    cli = str(env_dir / "bin" / "trlx-scale")  # the wheel's console script
    assert "grpo" in _run([cli, "--help"], str(outside), 120, env).stdout
    shape = ["--params", "1.5e9", "--layers", "28", "--hidden", "1536", "--heads", "12"]
    plan = _run([cli, "plan", *shape, "--gpus-per-node", "1", "--gpu", "h100"], str(outside), 300, env)
    assert "recommendation" in plan.stdout
    checked = _run([cli, "recipes", "check", "grpo-lora-1.5b-math-1xh100"], str(outside), 600, env)
    assert "check     ok" in checked.stdout
    run = outside / "run"
    _run([cli, "grpo", "--max_steps", "2", "--eval_size", "16", "--output_dir", str(run)], str(outside), 900, env)
    summary = read_run_summary(run)
    assert summary["steps"] == 2 and summary["model"].startswith(site)  # the installed package's embedded model
