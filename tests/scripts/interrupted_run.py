"""A GRPO run (checkpoint every step) that can stall at a chosen point so a test can kill -9 it there.

python tests/scripts/interrupted_run.py OUTPUT_DIR [--stall save:N | --stall generate:N] [--resume] [--max_steps M]
(or under torchrun / accelerate launch: every rank stalls at the same point; rank 0 writes the sentinel).

--stall save:N     the save of checkpoint-N stops after the model files, before the optimizer, RNG and trainer state
--stall generate:N the rollout of step N stops inside generation
--stall optimizer:N step N stops right before its optimizer step (gradients computed, weights not yet updated)
The stall writes OUTPUT_DIR/stalled (the test waits for it) and sleeps until killed. The run prints one JSON line
"RESULT {...}" at the end: the steps it trained and the checkpoint it resumed from.
"""

import argparse
import json
import os
import time

from peft import LoraConfig
from transformers import TrainerCallback

from trlx_scale import GRPOConfig, GRPOTrainer
from trlx_scale.reliability.checkpoints import resolve_resume_checkpoint
from trlx_scale.tasks import addition_dataset, default_model_path, exact_match_reward


class _RecordSteps(TrainerCallback):
    def __init__(self, steps: list[int]):
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--stall", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--max_steps", type=int, default=4)
    cli = parser.parse_args()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    args = GRPOConfig(
        output_dir=cli.output_dir,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=cli.max_steps,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="steps",
        save_steps=1,
        report_to="none",
        seed=5,
        bf16=False,
        disable_tqdm=True,
        **({"use_cpu": True, "ddp_backend": "gloo"} if distributed else {}),
    )
    trainer = StallingGRPOTrainer(
        model=default_model_path(),
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=addition_dataset("train", 64),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    trainer.steps_trained_here = []
    trainer.add_callback(_RecordSteps(trainer.steps_trained_here))
    trainer.add_callback(_StallBeforeOptimizerStep(trainer))
    if cli.stall:
        where, step = cli.stall.split(":")
        trainer.stall = (where, int(step))
    resumed_from = resolve_resume_checkpoint(True, cli.output_dir) if cli.resume else None
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    trained_steps = trainer.steps_trained_here
    if trainer.accelerator.is_main_process:
        print("RESULT " + json.dumps({"resumed_from": resumed_from, "trained_steps": trained_steps}), flush=True)


if __name__ == "__main__":
    main()
