"""DPO (full fine-tuning, fp32, reference model) on a ~34M-parameter Llama, under `accelerate launch`: writes what
the planner predicted for this run and what each process measured, for tests/test_planning_measured.py.

    accelerate launch [--config_file configs/accelerate/cpu_zero3.yaml] tests/distributed/dpo_memory_plan.py \
        MODEL_DIR REPORT_JSON

The model is big enough that the training state (16 B per parameter) and the reference (4 B) dominate the
interpreter's own memory, so the comparison checks the formulas, not a constant.
"""

import json
import os
import sys

import torch
from datasets import Dataset
from report import leave_group  # tests/distributed/report.py (the script's folder)
from transformers import AutoTokenizer

from trlx_scale import DPOConfig, DPOTrainer
from trlx_scale.planning.trainer_memory import current_rss_bytes


def main(model_dir: str, report_path: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pairs = [
        {"prompt": f"{a}+{b}=", "chosen": f"{a + b}", "rejected": f"{a + b + 1}"} for a in range(10) for b in range(10)
    ]
    args = DPOConfig(
        output_dir=os.path.join(os.path.dirname(report_path), "out"),
        per_device_train_batch_size=8 // world,  # the same global batch on 1 or 2 processes
        max_steps=3,
        logging_steps=1,
        learning_rate=1e-5,
        save_strategy="no",
        report_to="none",
        bf16=False,
        use_cpu=world == 1,
        ddp_backend="gloo" if world > 1 else None,
        seed=0,
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = DPOTrainer(
        model=model_dir, args=args, train_dataset=Dataset.from_list(pairs), processing_class=tokenizer
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "memory/planned_peak_gib" in entry]
    plan = trainer.memory_planner.planned_memory()
    report = {
        "rank": int(os.environ.get("RANK", "0")),
        "world_size": world,
        "backend": plan.layout.backend,
        "planned_peak_gib": logged[-1]["memory/planned_peak_gib"],
        "measured_peak_gib": logged[-1]["memory/peak_host_gib"],
        "runtime_baseline_gib": trainer.memory_planner.runtime_baseline_bytes / 2**30,
        "roles_gib": {r.role: r.peak / 2**30 for r in plan.roles},
        "final_rss_gib": current_rss_bytes() / 2**30,
        "params": sum(p.numel() for p in trainer.accelerator.unwrap_model(trainer.model).parameters()),
    }
    path = report_path if world == 1 else f"{report_path}.rank{report['rank']}"
    with open(path, "w") as handle:
        json.dump(report, handle, indent=1)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    leave_group()  # after main(): the trainer is unreferenced, so its gloo work is done before the group goes
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
