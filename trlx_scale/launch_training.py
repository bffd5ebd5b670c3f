"""``trlx-scale grpo|ppo|dpo``: TRL's ``trl grpo|dpo`` command line, launched through Accelerate as TRL's CLI does.

    trlx-scale grpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K \\
        --reward_funcs accuracy_reward --accelerate_config zero3
    trlx-scale grpo                                   # the embedded model on the embedded task, as `make run`
    trlx-scale grpo --recipe grpo-lora-1.5b-math-1xh100   # a shipped recipe, with its Accelerate config

Every argument the training script knows (its script arguments, every field of the trainer's config, TRL's
``ModelConfig``; ``--config FILE.yaml``; ``--recipe NAME``) goes to the script; the others go to ``accelerate
launch`` (``--num_processes``, ``--machine_rank``, ...). ``--accelerate_config`` takes a file or the name of a config
shipped in the package (``trlx_scale/accelerate_configs``: single_gpu, ddp, fsdp2, zero3, multinode_*, cpu_ddp,
cpu_zero3, ...); a ``--recipe`` brings its own when no launch argument is given. The script is the package's own (``trlx_scale/scripts/<algo>.py``, also ``examples/<algo>.py`` in a
source checkout): one code path.
"""

from __future__ import annotations

import importlib
import importlib.resources as resources
import os
import sys
from pathlib import Path

TRAINING_COMMANDS = {"grpo": "GRPO", "async_grpo": "asynchronous GRPO", "ppo": "PPO", "dpo": "DPO"}
ACCELERATE_CONFIG_FLAG = "--accelerate_config"
# Without --accelerate_config: one process, as `make run` launches (TRL leaves it to Accelerate's defaults, which
# warn about a missing default config and pick the same).
SINGLE_PROCESS_LAUNCH = {
    "--num_processes": "1",
    "--num_machines": "1",
    "--mixed_precision": "no",
    "--dynamo_backend": "no",
}


def shipped_accelerate_configs() -> list[str]:
    """The names ``--accelerate_config`` accepts besides a path."""
    folder = resources.files("trlx_scale").joinpath("accelerate_configs")
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def accelerate_config_path(name_or_path: str) -> str:
    """A config file given by path, or one shipped in the package given by name (without ``.yaml``)."""
    if Path(name_or_path).is_file():
        return name_or_path
    candidate = resources.files("trlx_scale").joinpath("accelerate_configs").joinpath(f"{name_or_path}.yaml")
    if not candidate.is_file():
        raise ValueError(
            f"{ACCELERATE_CONFIG_FLAG} {name_or_path}: neither a file nor a config shipped with trlx_scale; give a "
            f"path or one of {', '.join(shipped_accelerate_configs())}."
        )
    return str(candidate)


def script_path(command: str) -> str:
    return str(resources.files("trlx_scale.scripts").joinpath(f"{command}.py"))


def _without(arguments: list[str], removed: list[str]) -> list[str]:
    """``arguments`` without ``removed``, an ordered subsequence of it."""
    pending = iter(removed)
    current = next(pending, None)
    kept = []
    for argument in arguments:
        if current is not None and argument == current:
            current = next(pending, None)
        else:
            kept.append(argument)
    return kept


def _split_equals(argv: list[str]) -> list[str]:
    """``--flag=value`` as ``--flag value``, so that every flag is seen whichever form it was given in."""
    split = []
    for argument in argv:
        if argument.startswith("--") and "=" in argument:
            split.extend(argument.split("=", 1))
        else:
            split.append(argument)
    return split


# Accelerate's launcher modes: at most one of them (it refuses two), and --multi_gpu only when none was chosen.
LAUNCH_MODES = ("--cpu", "--multi_gpu", "--use_deepspeed", "--use_fsdp", "--tpu", "--use_megatron_lm")


def split_arguments(command: str, argv: list[str]) -> tuple[list[str], list[str]]:
    """(accelerate launch arguments, training script arguments) of ``trlx-scale <command> ARGV``."""
    from .recipes.catalog import load_recipe
    from .tasks.example_runtime import script_parser

    argv = _split_equals(argv)

    example = importlib.import_module(f"trlx_scale.scripts.{command}").EXAMPLE
    parser = script_parser(example, prog=f"trlx-scale {command}")
    if any(flag in argv for flag in ("-h", "--help")):
        parser.print_help()
        raise SystemExit(0)
    # What the script does not know is Accelerate's (TRL's CLI splits the same way).
    *_, unknown = parser.parse_known_args(_config_free(argv))
    launch = list(unknown)
    if not launch and "--recipe" in argv and argv.index("--recipe") + 1 < len(argv):
        launch = [ACCELERATE_CONFIG_FLAG, load_recipe(argv[argv.index("--recipe") + 1]).meta["accelerate_config"]]
    if ACCELERATE_CONFIG_FLAG in launch:
        index = launch.index(ACCELERATE_CONFIG_FLAG)
        if index + 1 >= len(launch):
            raise ValueError(f"{ACCELERATE_CONFIG_FLAG} needs a value: a file or a shipped config name.")
        path = accelerate_config_path(launch[index + 1])
        launch = ["--config_file", path, *launch[:index], *launch[index + 2 :]]
    elif "--config_file" not in launch:
        for flag, value in SINGLE_PROCESS_LAUNCH.items():
            if flag not in launch:
                launch += [flag, value]
        several = launch[launch.index("--num_processes") + 1] != "1"
        if several and not any(mode in launch for mode in LAUNCH_MODES):
            launch.insert(0, "--multi_gpu")  # several processes without a config: data parallel, as `make run` does
    return launch, _without(argv, unknown)


def _config_free(argv: list[str]) -> list[str]:
    """``argv`` without ``--config FILE`` / ``--recipe NAME``: their keys are checked by the script itself."""
    kept, skip = [], False
    for argument in argv:
        if skip:
            skip = False
            continue
        if argument in ("--config", "--recipe"):
            skip = True
            continue
        kept.append(argument)
    return kept


def run_training_command(command: str, argv: list[str]) -> int:
    """Replace this process by ``accelerate launch [launch args] <script> [script args]`` (signals then reach the
    launcher directly: a preempted job saves, see docs/reliability.md)."""
    try:
        launch, script_args = split_arguments(command, argv)
    except ValueError as error:
        print(f"trlx-scale {command}: {error}", file=sys.stderr)
        return 2
    arguments = [sys.executable, "-m", "accelerate.commands.launch", *launch, script_path(command), *script_args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, arguments)
    return 0  # not reached
