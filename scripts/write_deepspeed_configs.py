"""Write configs/deepspeed/*.json from trlx_scale.optim.deepspeed_zero3_config (a test checks they match)."""

import json
import os

from trlx_scale.optim.distributed_precision import deepspeed_zero3_config
from trlx_scale.optim.presets import PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

for name, offload in (("zero3_bf16_master.json", False), ("zero3_bf16_master_offload.json", True)):
    path = os.path.join(ROOT, "configs", "deepspeed", name)
    with open(path, "w") as handle:
        json.dump(deepspeed_zero3_config(PRESETS["grpo"], offload_optimizer=offload), handle, indent=2)
        handle.write("\n")
    print("wrote", path)
