# Copyright trlx_scale contributors. Apache-2.0.
"""GRPO with a tool, offline on CPU: the embedded tool model learns to call its calculator more often.

    python examples/grpo_tools.py                     # embedded tool model + calculator task, vLLM colocate (CPU)
    python examples/grpo_tools.py --max_steps 40 --seed 1

The task is the sum of three three-digit numbers (``trlx_scale.tasks.calculator_task``), which the tiny embedded model
cannot compute in its head but solves nearly always through one call of ``add``. Pre-trained on a mix of both
behaviours (``trlx_scale.tasks.tool_model``), it calls the tool on about half the problems; GRPO with ``tools=[add]``
and an exact-answer reward teaches it to call it on more. Held-out accuracy (greedy, the tool executed) is printed
before and after training.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Allow `python examples/grpo_tools.py` from a source checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", default=None, help="default: the embedded tool model")
    parser.add_argument("--output_dir", default="outputs/grpo_tools")
    parser.add_argument("--max_steps", type=int, default=30)
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--per_device_train_batch_size", type=int, default=64, help="completions per step")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--train_size", type=int, default=None, help="first N training prompts (all when unset)")
    parser.add_argument("--eval_size", type=int, default=200, help="held-out problems scored before and after")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--save", action="store_true", help="save the trained model to --output_dir")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from trlx_scale import GRPOConfig, GRPOTrainer
    from trlx_scale.tasks.calculator_task import add, calculator_dataset, calculator_problems, exact_answer
    from trlx_scale.tasks.tool_model import (
        evaluate_with_tool,
        format_evaluation,
        load_tool_model_tokenizer,
        tool_model_path,
    )

    model_path = args.model_name_or_path or tool_model_path()
    config = GRPOConfig(
        output_dir=args.output_dir,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=256,
        vllm_dtype="float32",
        max_tool_calling_iterations=1,
        max_completion_length=100,  # a call (about 65 tokens), the tool's result, the answer
        per_device_train_batch_size=args.per_device_train_batch_size,
        num_generations=args.num_generations,
        temperature=args.temperature,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=3,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        bf16=False,
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        reward_funcs=exact_answer,
        args=config,
        train_dataset=calculator_dataset("train", size=args.train_size),
        processing_class=load_tool_model_tokenizer(model_path),
        tools=[add],
    )
    held_out = calculator_problems("held_out", size=args.eval_size)
    tokenizer = trainer.processing_class

    before = evaluate_with_tool(trainer.model, tokenizer, held_out)
    print(f"held-out before: {format_evaluation(before)}", flush=True)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = evaluate_with_tool(trainer.model, tokenizer, held_out)
    print(f"held-out after:  {format_evaluation(after)}", flush=True)
    print(
        f"held-out accuracy {before['accuracy']:.1%} -> {after['accuracy']:.1%} "
        f"({100 * (after['accuracy'] - before['accuracy']):+.1f} points) in {args.max_steps} steps, "
        f"{seconds:.0f}s of training (seed {args.seed})",
        flush=True,
    )
    if args.save:
        trainer.save_model(args.output_dir)
    return {"before": before, "after": after, "train_seconds": seconds}


if __name__ == "__main__":
    main()
