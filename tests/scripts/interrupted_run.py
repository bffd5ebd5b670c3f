"""A GRPO run (checkpoint every step) that can stall at a chosen point so a test can kill -9 it there.

python tests/scripts/interrupted_run.py OUTPUT_DIR [--stall save:N | --stall generate:N] [--resume] [--max_steps M]
(or under torchrun / accelerate launch: every rank stalls at the same point; rank 0 writes the sentinel).

--stall save:N     the save of checkpoint-N stops after the model files, before the optimizer, RNG and trainer state
--stall generate:N the rollout of step N stops inside generation
--stall optimizer:N step N stops right before its optimizer step (gradients computed, weights not yet updated)
The stall writes OUTPUT_DIR/stalled (the test waits for it) and sleeps until killed. The run prints one JSON line
"RESULT {...}" at the end: the steps it trained, the checkpoint it resumed from, and the logged loss, reward and
gradient norm of every step of the run (those before a resume come from the checkpoint's trainer state).

--save_steps S     save every S steps (default 1)
--per_device_train_batch_size B   (default 4; 4 samples of each prompt, so B/4 prompts per rank per step)
--pid_dir DIR      each rank writes DIR/rank<R>.pid at start, and DIR/progress (rank 0) after each step
--slow_steps S     each step starts with S seconds of sleep (a long step, for signals to land inside one)
--dump_loaded_weights PATH   the trained parameters as this process's first step begins (after a resume: as loaded)

AsyncGRPOTrainer instead (full weights to a vLLM server the run does not own):
--async_server URL            the server; --max_staleness S (default 1); --preemption_grace_period G (default 20)
--slow_groups_from K          groups K and later take 60 s to score (the producer awaits it: cancellable), on rank
                              --slow_rank R only (default 0): a preempted save's window cannot complete in its grace
"""

import argparse
import json
import os
import time

from peft import LoraConfig
from transformers import TrainerCallback

from trlx_scale import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig, GRPOTrainer
from trlx_scale.async_grpo.producer_feed import ProducerFeed
from trlx_scale.process_exit import run_then_exit
from trlx_scale.reliability.checkpoints import resolve_resume_checkpoint
from trlx_scale.tasks import addition_dataset, default_model_path, exact_match_reward
from trlx_scale.tasks.example_runtime import cpu_launch_defaults


class _RecordSteps(TrainerCallback):
    def __init__(self, steps: list[int], progress_file: str | None = None):
        self.steps = steps
        self.progress_file = progress_file

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)
        if self.progress_file and state.is_world_process_zero:
            with open(self.progress_file + ".tmp", "w") as handle:
                handle.write(str(state.global_step))
            os.replace(self.progress_file + ".tmp", self.progress_file)


class _DumpWeightsAtFirstStep(TrainerCallback):
    """The trained parameters as the first step of this process starts (after a resume: what was loaded), gathered
    whole under ZeRO-3, written by rank 0 as {name: list} JSON."""

    def __init__(self, trainer, path: str):
        self.trainer, self.path, self.done = trainer, path, False

    def on_step_begin(self, args, state, control, **kwargs):
        if self.done:
            return
        self.done = True
        import contextlib

        import torch

        named = [(n, p) for n, p in self.trainer.model.named_parameters() if p.requires_grad]
        gather = contextlib.nullcontext()
        if self.trainer.is_deepspeed_enabled:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters([p for _, p in named])
        with gather, torch.no_grad():
            values = {n: p.detach().float().cpu().flatten().tolist() for n, p in named}
        if self.trainer.accelerator.is_main_process:
            with open(self.path, "w") as handle:
                json.dump(values, handle)


class _SlowSteps(TrainerCallback):
    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_begin(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


class _StallBeforeOptimizerStep(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._stall_here("optimizer", state.global_step + 1)


class StallingGRPOTrainer(GRPOTrainer):
    stall: tuple[str, int] | None = None

    def _stall_here(self, where: str, step: int) -> None:
        if self.stall == (where, step):
            if self.accelerator.is_main_process:
                with open(os.path.join(self.args.output_dir, "stalled"), "w") as handle:
                    handle.write(f"{where}:{step}")
            time.sleep(600)  # killed here

    def _save_optimizer_and_scheduler(self, output_dir):
        self._stall_here("save", self.state.global_step)
        super()._save_optimizer_and_scheduler(output_dir)

    def _generate_single_turn(self, *args, **kwargs):
        self._stall_here("generate", self.state.global_step + 1)
        return super()._generate_single_turn(*args, **kwargs)


class SlowScoringFeed(ProducerFeed):
    async def score_group(self, request, sampled):
        trainer = self.trainer
        if trainer.slow_from is not None and request.index >= trainer.slow_from:
            if trainer.accelerator.process_index == trainer.slow_rank:
                import asyncio

                await asyncio.sleep(60)  # a verifier that takes a minute (cancelled with the producer)
        return await super().score_group(request, sampled)


class SlowScoringAsyncTrainer(AsyncGRPOTrainer):
    slow_from: int | None = None
    slow_rank = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.producer_feed = SlowScoringFeed(self)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--stall", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--save_steps", type=int, default=1)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--pid_dir", default=None)
    parser.add_argument("--slow_steps", type=float, default=0.0)
    parser.add_argument("--dump_loaded_weights", default=None)
    parser.add_argument("--async_server", default=None)
    parser.add_argument("--max_staleness", type=int, default=1)
    parser.add_argument("--preemption_grace_period", type=float, default=20.0)
    parser.add_argument("--slow_groups_from", type=int, default=None)
    parser.add_argument("--slow_rank", type=int, default=0)
    parser.add_argument("--weight_delivery", default="auto")
    cli = parser.parse_args()
    asynchronous = {}
    if cli.async_server:
        asynchronous = dict(
            vllm_server_base_url=cli.async_server,
            max_staleness=cli.max_staleness,
            preemption_grace_period=cli.preemption_grace_period,
            request_timeout=300,
            weight_delivery=cli.weight_delivery,
        )
    args = (AsyncGRPOConfig if asynchronous else GRPOConfig)(
        output_dir=cli.output_dir,
        per_device_train_batch_size=cli.per_device_train_batch_size,
        num_generations=4,
        max_completion_length=4,
        max_steps=cli.max_steps,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="steps",
        save_steps=cli.save_steps,
        report_to="none",
        seed=5,
        disable_tqdm=True,
        **{"bf16": False, **cpu_launch_defaults()},  # gloo under a launcher (use_cpu too, except under DeepSpeed)
        **asynchronous,
    )
    trainer = (SlowScoringAsyncTrainer if asynchronous else StallingGRPOTrainer)(
        model=default_model_path(),
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=addition_dataset("train", 64),
        peft_config=None if asynchronous else LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    if asynchronous:
        trainer.slow_from, trainer.slow_rank = cli.slow_groups_from, cli.slow_rank
    trainer.steps_trained_here = []
    progress = None
    if cli.pid_dir:
        os.makedirs(cli.pid_dir, exist_ok=True)
        with open(os.path.join(cli.pid_dir, f"rank{trainer.accelerator.process_index}.pid"), "w") as handle:
            handle.write(str(os.getpid()))
        progress = os.path.join(cli.pid_dir, "progress")
    trainer.add_callback(_RecordSteps(trainer.steps_trained_here, progress))
    if not asynchronous:
        trainer.add_callback(_StallBeforeOptimizerStep(trainer))
    if cli.slow_steps:
        trainer.add_callback(_SlowSteps(cli.slow_steps))
    if cli.dump_loaded_weights:
        trainer.add_callback(_DumpWeightsAtFirstStep(trainer, cli.dump_loaded_weights))
    if cli.stall and not asynchronous:
        where, step = cli.stall.split(":")
        trainer.stall = (where, int(step))
    resumed_from = resolve_resume_checkpoint(True, cli.output_dir) if cli.resume else None
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    trained_steps = trainer.steps_trained_here
    logged = {
        entry["step"]: [entry["loss"], entry["reward"], entry["grad_norm"]]
        for entry in trainer.state.log_history
        if "loss" in entry
    }
    staleness = {
        entry["step"]: entry["async/staleness_max"]
        for entry in trainer.state.log_history
        if "async/staleness_max" in entry
    }
    if trainer.accelerator.is_main_process:
        result = {
            "resumed_from": resumed_from,
            "trained_steps": trained_steps,
            "logged": logged,
            "staleness": staleness,
        }
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    run_then_exit(main)
