"""Two gloo processes train GRPO with tools on their colocated vLLM engines; rank 0's trajectories take 1 turn (no
tool round), rank 1's take 4 (3 tool rounds). Each rank writes the tool calls of each step's rollout: both finish.

torchrun --nproc_per_node 2 tests/distributed/uneven_tool_turns.py OUTPUT_DIR
"""

import json
import os
import sys

import torch.distributed as dist
from transformers import AutoTokenizer

from trlx_scale import GRPOConfig, GRPOTrainer
from trlx_scale.tasks import default_model_path
from trlx_scale.tasks.tool_chat_template import every_turn_calls, with_tool_template


def lookup(q: str) -> str:
    """Look a query up.

    Args:
        q: The query.
    """
    return "ok"


class RecordingGRPOTrainer(GRPOTrainer):
    """Keeps the tool calls and turns of each rollout's tool loop (the trainer's own code runs unchanged)."""

    def _tool_call_loop(self, *args):
        result = super()._tool_call_loop(*args)
        stops = {k: v[-1] for k, v in self._metrics["train"].items() if k.startswith("agents/stopped_")}
        self.recorded.append({"calls": result[4], "turns": [len(c) for c in result[1]], "stops": stops})
        return result


def main(output_dir: str) -> None:
    rank = int(os.environ["RANK"])
    from datasets import Dataset

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i}+{i + 3}"}]} for i in range(32)])
    tokenizer = with_tool_template(AutoTokenizer.from_pretrained(default_model_path()))
    tokenizer.response_template = every_turn_calls("lookup", "q")  # a turn that starts with a digit calls the tool
    args = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=80,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",
        disable_tqdm=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=128,
        vllm_structured_outputs_regex="[0-9]",  # every turn one digit, so every turn calls the tool
        max_tool_calling_iterations=0 if rank == 0 else 3,  # 1 turn on rank 0, 4 on rank 1
        seed=3,
    )
    trainer = RecordingGRPOTrainer(
        model=default_model_path(),
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[lookup],
    )
    trainer.recorded = []
    trainer.train()
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as handle:
        json.dump({"steps": trainer.state.global_step, "rollouts": trainer.recorded}, handle)
    # Both ranks are done; leave without tearing down: a colocated engine's shutdown destroys the default group under
    # report.leave_group (compat/vllm_engine_finalizers.py), which then fails on an invalid group.
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
    from trlx_scale.process_exit import exit_process

    exit_process(0)  # without the interpreter's module teardown: trlx_scale/process_exit.py
