# Copyright trlx_scale contributors. Apache-2.0.
"""PPO (actor-critic, GAE, KL-penalized reward) with a colocated vLLM engine, on the embedded default model and
addition task or on any Hub model/dataset.

    accelerate launch examples/ppo.py                               # LoRA policy, separate critic, vLLM colocated
    accelerate launch examples/ppo.py --critic_mode shared_base     # critic = 2nd LoRA adapter on the policy's base
    accelerate launch examples/ppo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name <hub dataset with "prompt" and "answer" columns> --push_to_hub --hub_model_id me/my-ppo

Every field of `trlx_scale.PPOConfig`, `trl.ModelConfig` and the task arguments is a CLI flag (`--help` lists
them). PPO epochs and mini-batches per rollout are `--num_iterations` and `--steps_per_generation`. Accuracy is exact
match of the greedy completion on held-out prompts, before and after training.
"""

from __future__ import annotations

import os
import sys

# Allow `python examples/ppo.py` from a source checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The script itself ships in the package (`trlx-scale ppo` runs the same one): trlx_scale/scripts/ppo.py.
from trlx_scale.process_exit import run_then_exit  # noqa: E402
from trlx_scale.scripts.ppo import *  # noqa: E402, F403
from trlx_scale.scripts.ppo import main  # noqa: E402

if __name__ == "__main__":
    run_then_exit(main)
