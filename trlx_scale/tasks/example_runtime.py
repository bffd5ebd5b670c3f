"""What the examples share: one ``run_example`` (flags, defaults, data, trainer, held-out accuracy before and after,
save, model card, Hub push, summary), so that examples/grpo.py, ppo.py and dpo.py keep only what differs and every
flag behaves the same in all three.

    run_example(Example(trainer_cls=GRPOTrainer, config_cls=GRPOConfig, defaults=lambda parsed: {...}))
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainerCallback
from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config
from trl.models import unwrap_model_for_generation

from . import calculator_tool_run
from .addition import addition_dataset
from .calculator_tool_run import ADDITION, CALCULATOR_TOOLS
from .default_model import default_model_path
from .evaluation import exact_match_accuracy
from .recipe_files import recipe_arguments
from .reward_functions import EXACT_MATCH, resolve_reward_functions
from .run_summary import RunSummary
from .user_dataset import load_user_dataset, split_or_none


@dataclass
class TaskScriptArguments(ScriptArguments):
    """Dataset and evaluation options of the RL examples (TRL's `ScriptArguments` plus the fields below)."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset (or local path) with a 'prompt' column and an answer column. Unset: the embedded "
            "two-digit addition task."
        },
    )
    answer_column: str = field(
        default="answer",
        metadata={"help": "Column holding the expected answer; the reward is exact match against it."},
    )
    train_size: int | None = field(
        default=None, metadata={"help": "Use only the first N training prompts (all when unset)."}
    )
    eval_size: int | None = field(
        default=None,
        metadata={
            "help": "Held-out prompts: N rows of --dataset_test_split, or, when the dataset has no such split, N "
            "training rows held out of training. They are scored by exact match against --answer_column before and "
            "after training, and evaluated with the run's reward functions under --eval_strategy. Unset: every "
            "training row is trained on (600 on the embedded task; 0 there uses its whole held-out split)."
        },
    )
    eval_max_new_tokens: int = field(
        default=8, metadata={"help": "Tokens generated per held-out prompt when measuring accuracy."}
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions, as TRL's `trl grpo` names them: accuracy_reward, reasoning_accuracy_reward, "
            "think_format_reward, get_soft_overlong_punishment, exact_match (against --answer_column), or a dotted "
            "import path (my_module.my_reward). Unset: exact_match."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A reward model (Hub id or local path of a sequence-classification model), as in trl grpo."},
    )
    task: str = field(
        default=ADDITION,
        metadata={
            "help": "The embedded task when --dataset_name is unset: 'addition' (two-digit sums, the embedded "
            "default model) or 'calculator_tools' (sums of three three-digit numbers with an `add` tool, the embedded "
            "tool model, held-out accuracy with the tool executed; `trlx-scale grpo` and `trlx-scale async_grpo` "
            "only)."
        },
    )
    eval_every_steps: int | None = field(
        default=None,
        metadata={
            "help": "Also score the held-out prompts every N optimizer steps during training, for the accuracy curve "
            "of the report (greedy decoding with the random state kept: the training is the same). 0: only before "
            "and after. Unset: 50 on the embedded task (under a second each), 0 on a dataset of your own (600 "
            "greedy completions of a real model every 50 steps would cost minutes)."
        },
    )


def cpu_launch_defaults() -> dict:
    """On CPU: fp32 compute, and under a multi-process launcher the gloo process group (DeepSpeed ZeRO-3 included)."""
    if torch.cuda.is_available():
        return {}
    # The machine's settings, not the demo's: TRL's own parse refuses bf16 on a CPU (`trl grpo` needs
    # `--use_cpu true --bf16 false` there), so every run on this machine gets them.
    defaults: dict[str, Any] = {"bf16": False}
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        # Under a launcher, without use_cpu Accelerate sees no accelerator and treats the processes as independent
        # (its gathers become no-ops); with it, they form one gloo process group (DistributedType.MULTI_CPU).
        # DeepSpeed on CPU runs through ddp_backend="gloo" instead, and refuses use_cpu.
        defaults["use_cpu"] = True
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        defaults["ddp_backend"] = "gloo"  # the process group that runs on CPU (DeepSpeed included)
    return defaults


def resume_argument(value: str | None) -> str | bool | None:
    """--resume_from_checkpoint: a checkpoint path, 'true'/'latest' for the newest one in output_dir, or off."""
    if value is None or value.lower() in ("", "false", "none"):
        return None
    if value.lower() in ("true", "latest"):
        return True
    return value


def eval_strategy(config) -> str:
    """The config's ``eval_strategy`` as the flag spells it ("no", "steps", "epoch")."""
    return str(getattr(config.eval_strategy, "value", config.eval_strategy))


@dataclass
class TaskData:
    """What a run trains and evaluates on.

    train: the rows trained on.
    held_out: prompts with their answers for the exact-match accuracy before and after training (the embedded tasks;
        a user's dataset with an answer column and ``--eval_size N``), or None.
    evaluation: what the trainer evaluates every ``eval_steps`` with the run's own reward functions under
        ``--eval_strategy steps|epoch`` (TRL's ``eval_dataset``): the dataset's test split, else the held-out rows;
        None when the run does not evaluate.
    """

    train: Any
    held_out: Any = None
    evaluation: Any = None


def load_prompt_task(script_args: TaskScriptArguments, config, dataset_args=None) -> TaskData:
    """The embedded addition task, or a user's prompt dataset with every training row trained on unless
    ``--eval_size N`` asks for N held-out rows (from ``--dataset_test_split`` when the dataset has it)."""
    evaluates = eval_strategy(config) != "no"
    if trains_embedded_task(script_args, dataset_args):
        train = addition_dataset("train", size=script_args.train_size)
        held_out = addition_dataset("held_out", size=script_args.eval_size or None)
        return TaskData(train, held_out, held_out if evaluates else None)
    dataset = load_user_dataset(script_args, dataset_args)
    label = script_args.dataset_name or "the `datasets` mixture"
    if script_args.dataset_train_split not in dataset:
        raise ValueError(
            f"Dataset {label!r} has no split {script_args.dataset_train_split!r} (splits: {list(dataset)}): pass "
            "--dataset_train_split."
        )
    train = dataset[script_args.dataset_train_split]
    # The answer column serves exact match (the default reward) and the held-out accuracy; with other reward
    # functions (--reward_funcs accuracy_reward reads "solution") a dataset without it trains.
    needs_answer = not script_args.reward_funcs or EXACT_MATCH in script_args.reward_funcs
    needed = ("prompt", script_args.answer_column) if needs_answer else ("prompt",)
    for column in needed:
        if column not in train.column_names:
            raise ValueError(
                f"Dataset {label!r} has no {column!r} column (columns: {train.column_names}). Rename its columns, or "
                "pass --answer_column for the answer."
            )
    test = split_or_none(dataset, script_args.dataset_test_split)
    held_out = None
    if script_args.eval_size:
        if test is not None:
            held_out = test
        else:
            if script_args.eval_size >= len(train):
                raise ValueError(
                    f"--eval_size={script_args.eval_size} would take every row of the {len(train)}-row train split "
                    "for evaluation (the dataset has no test split): lower --eval_size."
                )
            split = train.train_test_split(test_size=script_args.eval_size, seed=config.seed)
            train, held_out = split["train"], split["test"]
        check_split_size("--eval_size", script_args.eval_size, len(held_out), "held-out")
        held_out = held_out.select(range(script_args.eval_size))
    evaluation = None
    if evaluates:
        evaluation = test if test is not None else held_out
        if evaluation is None:
            raise ValueError(
                f"--eval_strategy {eval_strategy(config)} needs prompts to evaluate: dataset {label!r} has no "
                f"{script_args.dataset_test_split!r} split; pass --dataset_test_split, or --eval_size N to hold N "
                "training rows out."
            )
    train = _first_rows(train, script_args.train_size, script_args.dataset_train_split)
    scoreable = held_out is not None and script_args.answer_column in held_out.column_names
    return TaskData(train, held_out if scoreable else None, evaluation)


def _first_rows(train, train_size: int | None, split: str):
    check_split_size("--train_size", train_size, len(train), split)
    return train if train_size is None else train.select(range(train_size))


def check_split_size(flag: str, asked: int | None, available: int, split: str) -> None:
    """A size larger than the split would silently train or evaluate on fewer rows than the summary claims."""
    if asked is not None and asked > available:
        raise ValueError(
            f"{flag}={asked} asks for more rows than the {split} split has ({available}); pass {flag} {available} "
            "or less."
        )


def held_out_accuracy(trainer, held_out, answer_column: str, max_new_tokens: int) -> float | None:
    """Exact-match accuracy of greedy completions on ``held_out`` (None when there is no held-out set)."""
    if held_out is None or len(held_out) == 0:
        return None
    # Under ZeRO-3 the weights are partitioned: every process gathers them for generation (a collective).
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
        return exact_match_accuracy(
            model,
            trainer.processing_class,
            held_out["prompt"],
            held_out[answer_column],
            max_new_tokens=max_new_tokens,
            progress=trainer.accelerator.is_main_process and not trainer.args.disable_tqdm,
        )


EMBEDDED_TASK_EVAL_EVERY = 50


class HeldOutAccuracyCurve(TrainerCallback):
    """Scores the held-out prompts after every ``every`` optimizer steps (not after the last one: the run's "after"
    is).

    Every process takes part (under ZeRO-3 the generation gathers the weights). The random state of torch (CPU and
    the accelerator) is restored afterwards, so the run trains exactly as it would without the curve; the time it
    takes is kept out of the summary's training time (``seconds``); the profiler counts it in the next step's
    ``time/other``, as it counts any evaluation between steps."""

    def __init__(self, accuracy: Callable[[], float | None], every: int):
        if every < 0:
            raise ValueError(f"--eval_every_steps must be >= 0 (0: only before and after), got {every}.")
        self._accuracy, self.every = accuracy, every
        self.points: list[tuple[int, float]] = []
        self.seconds = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        # At the start of the step after every `every` completed ones: a run that stops after a step (its last, or
        # a preemption's save) never spends time on a point it cannot use; every rank gets here together.
        step = state.global_step
        if self.every == 0 or step == 0 or step % self.every != 0:
            return
        start = time.perf_counter()
        with torch.random.fork_rng(devices=_rng_devices()):
            value = self._accuracy()
        self.seconds += time.perf_counter() - start
        if value is not None:
            self.points.append((step, value))


def _rng_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def finish_run(trainer, summary: RunSummary, output_dir: str, dataset_label: str, push_to_hub: bool) -> dict:
    """Save the model with its card, the logs (``trainer_state.json``), ``run_summary.json`` and the report, print the
    summary and where the report is, then push when asked (a failed upload leaves everything local in place)."""
    trainer.save_model(output_dir)
    trainer.save_state()  # trainer_state.json: the log history that `trlx-scale report` reads
    if trainer.accelerator.is_main_process:
        summary.write_json(os.path.join(output_dir, "run_summary.json"))  # first: the card quotes its accuracy
        trainer.create_model_card(dataset_name=dataset_label)  # README.md beside the weights, also offline
        print(summary.render(), flush=True)
        print(report_line(output_dir), flush=True)
    if push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_label)
    return summary.as_dict()


def report_line(output_dir: str) -> str:
    """Write the run's report (plots + report.md) and say where it is; without matplotlib, say how to get it."""
    from ..report.render import write_report

    try:
        report = write_report(output_dir)
    except ImportError as error:
        return f"report           not drawn: {error} Then: trlx-scale report {output_dir}"
    return f"report           {report.markdown} (plots: {', '.join(os.path.basename(p) for p in report.images)})"


# ---------------------------------------------------------------------------------------------- run_example
# Defaults every example shares: the embedded model through a rank-64 LoRA on all linear layers (tuned on the embedded
# task: rank 64 learns clearly faster than 16 there), an fp32 engine matching the CPU trainer (on-policy gap at noise),
# and a short warmup into a constant schedule.
SHARED_EXAMPLE_DEFAULTS: dict[str, Any] = dict(
    use_peft=True,
    lora_r=64,
    lora_alpha=128,
    lora_dropout=0.0,
    lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    vllm_dtype="trainer",
    lr_scheduler_type="constant_with_warmup",
    warmup_steps=5,
    save_strategy="no",
    report_to="none",
    seed=42,
)
# What the on-policy RL examples (GRPO, PPO) share on the embedded task: vLLM colocated, 16 prompts x 8 completions per
# process and step, completions long enough for a two-digit answer, 200 steps at the LoRA learning rate tuned there
# (docs/quickstart.md: at 1e-3 LoRA gains less and at 2e-3 it collapses), and each prompt's completions scored with
# one pass over the prompt (shared_prefix; exact, off with the reason logged where it cannot apply).
ROLLOUT_EXAMPLE_DEFAULTS: dict[str, Any] = dict(
    use_vllm=True,
    vllm_mode="colocate",
    max_steps=200,
    per_device_train_batch_size=128,
    num_generations=8,
    max_completion_length=6,
    temperature=1.0,
    learning_rate=5e-4,
    shared_prefix="auto",
    logging_steps=20,
)
# The embedded task's own script defaults: 600 held-out problems scored before and after training.
EMBEDDED_TASK_SCRIPT_DEFAULTS: dict[str, Any] = dict(eval_size=600)
# Fields an --optim_preset fills: an example's own values for them step aside when a preset is chosen, whether on the
# command line or in a --config file.
OPTIMIZER_FIELDS = ("learning_rate", "lr_scheduler_type", "warmup_steps")


@dataclass
class Example:
    """What one example adds to ``run_example``.

    defaults: the example's own defaults, given the first parse of the flags (None on that first parse), so that a
        default may depend on another flag (DPO's ``--online``) from the command line or a ``--config`` file.
    load_data: (script args, config, dataset mixture args) -> ``TaskData``.
    trainer_kwargs: (config, reward functions) -> extra keyword arguments of the trainer (e.g. ``reward_funcs``).
    """

    trainer_cls: type
    config_cls: type
    defaults: Callable[[Any], dict[str, Any]]
    script_args_cls: type = field(default_factory=lambda: TaskScriptArguments)
    load_data: Callable[..., TaskData] = field(default_factory=lambda: _load_prompt_data)
    trainer_kwargs: Callable[[Any, list], dict[str, Any]] = field(
        default_factory=lambda: lambda config, reward: {"reward_funcs": reward}
    )
    reward_key: str = "reward"
    takes_tools: bool = False  # the trainer trains with tools (--task calculator_tools)


def _load_prompt_data(script_args, config, dataset_args=None) -> TaskData:
    return load_prompt_task(script_args, config, dataset_args)


def script_parser(example: Example, prog: str | None = None) -> TrlParser:
    """TRL's parser over the example's script arguments, the trainer's config, TRL's ``ModelConfig`` and TRL's
    ``DatasetMixtureConfig`` (the four dataclasses ``trl grpo`` parses)."""
    return TrlParser((example.script_args_cls, example.config_cls, ModelConfig, DatasetMixtureConfig), prog=prog)


def trains_embedded_task(script_args, dataset_args: DatasetMixtureConfig | None = None) -> bool:
    """A run trains an embedded task when it names no dataset (``--dataset_name``, or a ``datasets`` mixture in a
    ``--config`` file): only then do the demo's tuned settings apply. A user's dataset gets the config's defaults, as
    ``trl grpo`` gives them."""
    return not script_args.dataset_name and not (dataset_args is not None and dataset_args.datasets)


def _script_arguments_alone(example: Example, argv: list[str], recipe_values: dict[str, Any]):
    """(script args, dataset mixture args) before any config default is chosen: which defaults apply depends on
    them, and a config parsed with the wrong defaults could refuse flags that are valid with the right ones."""
    parser = TrlParser((example.script_args_cls, DatasetMixtureConfig), add_help=False)  # --help: the full parser's
    parser.set_defaults_with_config(**recipe_values)
    script_args, dataset_args, _ = parser.parse_args_and_config(argv, return_remaining_strings=True)
    return script_args, dataset_args


def parse_example_flags(example: Example, argv: list[str]):
    """(script args, config, model args, dataset mixture args): TRL's parser over the four dataclasses, with the
    defaults that apply to the run, then a recipe's values (``--recipe NAME`` or ``--config RECIPE.yaml``), then the
    command line.

    The defaults that apply: on an embedded task (no dataset named), the demo's tuned settings; on a user's dataset,
    the config's own (TRL's, plus trlx_scale's documented ones: docs/defaults.md). On a machine without a GPU the
    hardware's (fp32, the CPU device) apply to both."""
    argv, recipe_values = recipe_arguments(argv)
    class_defaults = {f.name: f.default for f in dataclasses.fields(example.config_cls)}
    embedded = trains_embedded_task(*_script_arguments_alone(example, argv, recipe_values))

    def parse(first_pass, first_script=None):
        # A parser per parse: TRL's parser keeps the defaults an earlier call set.
        parser = script_parser(example)
        defaults: dict[str, Any] = {"model_name_or_path": default_model_path()}
        if embedded:
            defaults.update(EMBEDDED_TASK_SCRIPT_DEFAULTS)
            defaults.update(SHARED_EXAMPLE_DEFAULTS)
            defaults.update(example.defaults(first_pass))
            if first_script is not None and first_script.task == CALCULATOR_TOOLS:
                defaults.update(calculator_tool_run.task_defaults(example.config_cls))
            if first_pass is not None and getattr(first_pass, "optim_preset", None) is not None:
                defaults.update({name: class_defaults[name] for name in OPTIMIZER_FIELDS})
        defaults.update(cpu_launch_defaults())
        defaults.update(recipe_values)
        unused = parser.set_defaults_with_config(**defaults)
        unknown = [key for key in recipe_values if f"--{key}" in unused]
        if unknown:
            raise ValueError(
                f"the recipe sets {unknown}, which are no fields of {example.config_cls.__name__} "
                "or of the script's arguments: fix the recipe."
            )
        return parser.parse_args_and_config(argv)

    first = parse(None)
    first_script, first_config = first[0], first[1]
    calculator_tool_run.check_task(
        first_script.task, example.takes_tools, example.trainer_cls.__name__, first_script.dataset_name or None
    )
    # The embedded task's defaults may depend on the first parse (DPO's --online, --task, --optim_preset); a user's
    # run has its defaults already.
    script_args, config, model_args, dataset_args = parse(first_config, first_script) if embedded else first
    # `--dataset_name ""` unsets a dataset a recipe or config file named: the embedded task then.
    script_args.dataset_name = script_args.dataset_name or None
    return script_args, config, model_args, dataset_args


def model_init_kwargs(config, model_args) -> dict[str, Any]:
    """The policy's loading arguments as ``trl grpo`` builds them from ``ModelConfig``, the config's own last."""
    return {
        "revision": model_args.model_revision,
        "trust_remote_code": config.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(config.model_init_kwargs or {}),
    }


def run_example(example: Example, argv: list[str] | None = None) -> dict:
    """Parse the flags, train, measure held-out accuracy before and after, save (and push), print the summary."""
    argv = sys.argv[1:] if argv is None else argv
    script_args, config, model_args, dataset_args = parse_example_flags(example, argv)
    embedded = trains_embedded_task(script_args, dataset_args)
    with_tools = script_args.task == CALCULATOR_TOOLS
    if with_tools:
        data = TaskData(*calculator_tool_run.task_data(script_args.train_size, script_args.eval_size))
    else:
        data = example.load_data(script_args, config, dataset_args)
    held_out = data.held_out
    answer_column = script_args.answer_column

    if with_tools and not script_args.reward_funcs:
        rewards = calculator_tool_run.task_reward_functions()
    else:
        rewards = resolve_reward_functions(script_args.reward_funcs, answer_column)
    if script_args.reward_model_name_or_path:
        rewards = [script_args.reward_model_name_or_path, *rewards]

    if not embedded:
        config.model_init_kwargs = model_init_kwargs(config, model_args)
    elif model_args.dtype is not None:  # --dtype loads the embedded policy in that dtype
        config.model_init_kwargs = {**(config.model_init_kwargs or {}), "dtype": model_args.dtype}
    quantization = get_quantization_config(model_args)
    trainer = example.trainer_cls(
        model=model_args.model_name_or_path,
        args=config,
        train_dataset=data.train,
        eval_dataset=data.evaluation,
        peft_config=get_peft_config(model_args),
        **({"quantization_config": quantization} if quantization is not None else {}),
        **example.trainer_kwargs(config, rewards),
        **(calculator_tool_run.task_trainer_kwargs(model_args.model_name_or_path) if with_tools else {}),
    )

    def accuracy() -> float | None:
        if with_tools:
            return calculator_tool_run.held_out_tool_accuracy(trainer, held_out)
        column = answer_column if held_out is not None and answer_column in held_out.column_names else "answer"
        return held_out_accuracy(trainer, held_out, column, script_args.eval_max_new_tokens)

    summary = RunSummary(
        model=model_args.model_name_or_path,
        world_size=trainer.accelerator.num_processes,
        train_rows=len(data.train) if hasattr(data.train, "__len__") else None,
    )
    summary.accuracy_before = accuracy()
    every = script_args.eval_every_steps
    every = (EMBEDDED_TASK_EVAL_EVERY if embedded else 0) if every is None else every
    curve = HeldOutAccuracyCurve(accuracy, every)
    evaluated = summary.accuracy_before is not None
    if evaluated:
        trainer.add_callback(curve)
    start = time.perf_counter()
    try:
        trainer.train(resume_from_checkpoint=resume_argument(config.resume_from_checkpoint))
    finally:
        if evaluated:
            trainer.remove_callback(curve)  # its closure holds the trainer: no trainer <-> callback cycle is left
    summary.train_seconds = time.perf_counter() - start - curve.seconds
    summary.accuracy_after = accuracy()
    if summary.accuracy_before is not None:
        summary.accuracy_curve = [(0, summary.accuracy_before), *curve.points]
        summary.accuracy_curve.append((trainer.state.global_step, summary.accuracy_after))
    summary.read_log_history(trainer.state.log_history, trainer.state.global_step, reward_key=example.reward_key)
    if embedded:
        dataset_label = calculator_tool_run.DATASET_LABEL if with_tools else "trlx_scale/addition"
    else:
        dataset_label = script_args.dataset_name or ", ".join(d.path for d in dataset_args.datasets)
    return finish_run(trainer, summary, config.output_dir, dataset_label, config.push_to_hub)
