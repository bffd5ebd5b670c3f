from .distributed_precision import deepspeed_zero3_config, fsdp2_mixed_precision_policy
from .master_weights import FP32MasterAdamW, cast_for_master_weights
from .presets import PRESETS, OptimizerPreset, apply_preset, get_preset

__all__ = [
    "PRESETS",
    "FP32MasterAdamW",
    "OptimizerPreset",
    "apply_preset",
    "cast_for_master_weights",
    "deepspeed_zero3_config",
    "fsdp2_mixed_precision_policy",
    "get_preset",
]
