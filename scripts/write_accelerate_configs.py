"""Write the GPU configs of configs/accelerate/ from trlx_scale.launch_config.SHIPPED_CONFIGS (a test compares)."""

import os

from trlx_scale.launch_config import SHIPPED_CONFIGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

for name, plan in SHIPPED_CONFIGS.items():
    path = os.path.join(ROOT, "configs", "accelerate", name)
    with open(path, "w") as handle:
        handle.write(plan.to_yaml())
    print("wrote", path)
