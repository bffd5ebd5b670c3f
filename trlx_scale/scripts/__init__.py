"""The training scripts behind ``trlx-scale grpo|ppo|dpo`` (and ``examples/<algo>.py``): each an ``Example`` of the
shared runtime (``tasks.example_runtime``) with its own defaults, runnable with ``accelerate launch``."""
