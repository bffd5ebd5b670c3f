# Copyright trlx_scale contributors. Apache-2.0.
"""GRPO with a colocated vLLM engine, on the embedded default model and addition task or on any Hub model/dataset.

    accelerate launch examples/grpo.py                                  # embedded model + task, LoRA, vLLM colocate
    accelerate launch examples/grpo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name <hub dataset with "prompt" and "answer" columns> --push_to_hub --hub_model_id me/my-grpo

Every field of `trlx_scale.GRPOConfig`, `trl.ModelConfig` and the task arguments is a CLI flag (`--help` lists
them; `--config file.yaml` sets them too). Accuracy is exact match of the greedy completion on held-out prompts,
before and after training. What all examples share is in `trlx_scale.tasks.example_runtime`.
"""

from __future__ import annotations

import os
import sys

# Allow `python examples/grpo.py` from a source checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The script itself ships in the package (`trlx-scale grpo` runs the same one): trlx_scale/scripts/grpo.py.
from trlx_scale.process_exit import run_then_exit  # noqa: E402
from trlx_scale.scripts.grpo import *  # noqa: E402, F403
from trlx_scale.scripts.grpo import main  # noqa: E402

if __name__ == "__main__":
    run_then_exit(main)
