"""``trlx-scale recipes check``: a recipe parses into its trainer's config, and the planner says it fits on the
hardware it names with the memory per GPU it states.

The run the planner sizes is read from the recipe's own config (algorithm, LoRA rank, micro-batch, lengths, group
size, checkpointing, precision, the engine's share and tensor-parallel size) and its ``recipe`` block (the model's
shape, the prompt length it plans for, the GPU, nodes and GPUs per node, the backend its Accelerate config uses), so
the stated memory cannot drift from the configuration that runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass

from .planning.hardware import resolve_accelerator
from .planning.memory_model import Plan, RunSpec
from .planning.model_shape import ModelShape
from .planning.planner import plan
from .recipes.catalog import Recipe

# The backend (and offload) each shipped Accelerate config runs.
BACKEND_OF_CONFIG = {
    "single_gpu": ("ddp", False),
    "ddp": ("ddp", False),
    "zero2": ("zero2", False),
    "zero3": ("zero3", False),
    "zero3_offload": ("zero3", True),
    "multinode_zero3": ("zero3", False),
    "fsdp2": ("fsdp2", False),
    "fsdp2_offload": ("fsdp2", True),
    "multinode_fsdp2": ("fsdp2", False),
}
# The planner's figure may move a little with its own refinements; beyond this the recipe's statement is stale.
TOLERANCE_GIB = 1.0


@dataclass
class RecipeCheck:
    recipe: Recipe
    plan: Plan

    @property
    def planned_gib(self) -> float:
        return self.plan.per_gpu_gib

    def problems(self) -> list[str]:
        found = []
        if not self.plan.fits:
            found.append(
                f"the planner says it does not fit: peak {self.planned_gib:.1f} of {self.plan.gpu_memory_gib:g} GiB"
            )
        expected = float(self.recipe.meta["expected_gib_per_gpu"])
        if abs(expected - self.planned_gib) > TOLERANCE_GIB:
            found.append(
                f"it states {expected:.1f} GiB per GPU, the planner now says {self.planned_gib:.1f}: update "
                "expected_gib_per_gpu"
            )
        return found


def parsed_config(recipe: Recipe, cpu_only: bool):
    """The recipe's config block through the training script's own parser (every key must be a field). On a
    machine without a GPU the bf16 switches are turned off for the parse (TrainingArguments refuses bf16 there)."""
    from .tasks.example_runtime import script_parser

    example = importlib.import_module(f"trlx_scale.scripts.{recipe.command}").EXAMPLE
    parser = script_parser(example)
    values = dict(recipe.config)
    if cpu_only:
        values.update(bf16=False, fp16=False)
    unused = parser.set_defaults_with_config(**values)
    if unused:
        raise ValueError(f"recipe {recipe.name}: {unused[::2]} are no fields of the {recipe.command} script.")
    script_args, config, model_args, _ = parser.parse_args_and_config([])
    return script_args, config, model_args


def run_spec(recipe: Recipe, config, model_args) -> RunSpec:
    shape = dict(recipe.meta["model_shape"])
    prompt_length = int(shape.pop("prompt_length", 512))
    shape["params"] = float(shape["params"])  # YAML reads 7.62e9 (no sign in the exponent) as a string
    model = ModelShape(name=str(model_args.model_name_or_path), **shape).complete()
    command = recipe.command
    algo = ("online-dpo" if getattr(config, "online", False) else "dpo") if command == "dpo" else command
    if command == "dpo":
        length = int(config.max_length or 1024)
        prompt, completion = length // 2, length - length // 2
    else:
        prompt, completion = prompt_length, int(config.max_completion_length)
    uses_masters = bool(config.uses_fp32_master_weights)
    engine = bool(getattr(config, "use_vllm", False)) or algo == "online-dpo"
    return RunSpec(
        model=model,
        algo=algo,
        lora_rank=model_args.lora_r if model_args.use_peft else None,
        prompt_length=prompt,
        completion_length=completion,
        micro_batch=int(config.per_device_train_batch_size),
        num_generations=int(getattr(config, "num_generations", None) or getattr(config, "online_num_generations", 2)),
        gradient_checkpointing=bool(config.gradient_checkpointing),
        precision="bf16-master" if uses_masters else ("bf16" if recipe.config.get("bf16") else "fp32"),
        vllm=engine,
        vllm_gpu_memory_utilization=float(getattr(config, "vllm_gpu_memory_utilization", 0.3)),
        vllm_tensor_parallel_size=int(getattr(config, "vllm_tensor_parallel_size", 1)),
        vllm_sleep=bool(getattr(config, "vllm_enable_sleep_mode", False)),
        **_roles(recipe, config),
    )


def _roles(recipe: Recipe, config) -> dict:
    if recipe.command == "ppo":
        return {"critic_mode": config.critic_mode, "critic_lora": bool(config.critic_use_peft), "reference": True}
    if recipe.command == "grpo":
        return {"reference": float(config.beta) != 0.0}
    return {}


def check_recipe(recipe: Recipe, cpu_only: bool = True) -> RecipeCheck:
    _, config, model_args = parsed_config(recipe, cpu_only)
    hardware = recipe.hardware
    config_name = recipe.meta["accelerate_config"]
    if config_name not in BACKEND_OF_CONFIG:
        raise ValueError(
            f"recipe {recipe.name}: accelerate_config {config_name!r} is not one of {list(BACKEND_OF_CONFIG)}."
        )
    backend, offload = BACKEND_OF_CONFIG[config_name]
    accelerator = resolve_accelerator(hardware["gpu"], hardware.get("gpu_memory_gb"))
    nodes, gpus = int(hardware.get("nodes", 1)), int(hardware.get("gpus_per_node", 1))
    report = plan(run_spec(recipe, config, model_args), accelerator, nodes, gpus, (backend,), offload)
    chosen = next(p for p in report.plans if p.layout.offload == offload)
    return RecipeCheck(recipe, chosen)


def describe(check: RecipeCheck) -> str:
    recipe, hardware = check.recipe, check.recipe.hardware
    nodes, gpus = hardware.get("nodes", 1), hardware.get("gpus_per_node", 1)
    status = "ok" if not check.problems() else "PROBLEM: " + "; ".join(check.problems())
    return (
        f"{recipe.name}: {recipe.meta['description']}\n"
        f"  hardware  {nodes} x {gpus} {hardware['gpu']}, {recipe.meta['accelerate_config']}\n"
        f"  memory    {check.planned_gib:.1f} GiB per GPU planned (recipe states {recipe.meta['expected_gib_per_gpu']})"
        f", {check.plan.gpu_memory_gib:g} GiB available\n"
        f"  dataset   {recipe.meta.get('dataset_columns', {})}\n"
        f"  launch    {recipe.launch_line()}\n"
        f"  check     {status}"
    )


def add_recipes_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("recipes", help="list, show or check the shipped recipes (real models, real GPUs)")
    parser.add_argument("action", nargs="?", choices=("list", "show", "check"), default="list")
    parser.add_argument("names", nargs="*", help="recipes to show or check (default: all)")
    parser.set_defaults(handler=run_recipes)
    return parser


def run_recipes(args: argparse.Namespace) -> int:
    from .generation.cpu_environment import running_on_cpu_only
    from .recipes.catalog import load_recipe, recipe_names

    names = args.names or recipe_names()
    try:
        recipes = [load_recipe(name) for name in names]
        if args.action == "list":
            for recipe in recipes:
                hardware = recipe.hardware
                print(
                    f"{recipe.name:<34} {recipe.command:<5} {hardware.get('nodes', 1)} x {hardware.get('gpus_per_node', 1)} "
                    f"{hardware['gpu']:<8} {recipe.meta['expected_gib_per_gpu']:>6} GiB/GPU  {recipe.meta['description']}"
                )
            return 0
        if args.action == "show":
            for recipe in recipes:
                with open(recipe.path) as handle:
                    print(handle.read())
            return 0
        failed = 0
        for recipe in recipes:
            check = check_recipe(recipe, cpu_only=running_on_cpu_only())
            print(describe(check))
            failed += bool(check.problems())
        return 1 if failed else 0
    except ValueError as error:
        print(f"trlx-scale recipes: {error}", file=sys.stderr)
        return 2
