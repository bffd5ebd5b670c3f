# Copyright trlx_scale contributors. Apache-2.0.
"""DPO on the embedded default model and addition task (offline preference pairs, or online with the colocated
vLLM engine), or on any Hub model/preference dataset.

    accelerate launch examples/dpo.py                       # offline: correct answer chosen over a wrong one, LoRA
    accelerate launch examples/dpo.py --online              # online: the policy samples, exact match ranks, vLLM
    python examples/dpo.py --vllm_ref_log_probs             # reference log-probs precomputed by vLLM
    accelerate launch examples/dpo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name trl-lib/ultrafeedback_binarized --eval_size 0 --push_to_hub --hub_model_id me/my-dpo

Every field of `trlx_scale.DPOConfig`, `trl.ModelConfig` and the script arguments below is a CLI flag (`--help`
lists them). On the embedded task, accuracy is exact match of the greedy completion on held-out prompts, before and
after training.
"""

from __future__ import annotations

import os
import sys

# Allow `python examples/dpo.py` from a source checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The script itself ships in the package (`trlx-scale dpo` runs the same one): trlx_scale/scripts/dpo.py.
from trlx_scale.process_exit import run_then_exit  # noqa: E402
from trlx_scale.scripts.dpo import *  # noqa: E402, F403
from trlx_scale.scripts.dpo import main  # noqa: E402

if __name__ == "__main__":
    run_then_exit(main)
