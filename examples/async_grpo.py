# Copyright trlx_scale contributors. Apache-2.0.
"""Asynchronous GRPO: generation on a vLLM server overlapping training (trlx_scale/scripts/async_grpo.py).

    accelerate launch examples/async_grpo.py            # embedded model + task; the trainer starts its own server
    trlx-scale serve Qwen/Qwen3-0.6B --port 8000 --devices 4,5,6,7 &
    accelerate launch examples/async_grpo.py --model_name_or_path Qwen/Qwen3-0.6B \\
        --vllm_server_base_url http://127.0.0.1:8000 --max_staleness 2 \\
        --dataset_name <hub dataset with "prompt" and "answer" columns> --push_to_hub --hub_model_id me/my-grpo

Every field of `trlx_scale.AsyncGRPOConfig`, `trl.ModelConfig` and the task arguments is a CLI flag (`--help` lists
them; `--config file.yaml` sets them too). Accuracy is exact match of the greedy completion on held-out prompts,
before and after training. The process layout and the metrics: docs/async.md.
"""

from __future__ import annotations

import os
import sys

# Allow `python examples/async_grpo.py` from a source checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The script itself ships in the package (`trlx-scale async_grpo` runs the same one): trlx_scale.scripts.async_grpo.py.
from trlx_scale.process_exit import run_then_exit  # noqa: E402
from trlx_scale.scripts.async_grpo import *  # noqa: E402, F403
from trlx_scale.scripts.async_grpo import main  # noqa: E402

if __name__ == "__main__":
    run_then_exit(main)
