"""bf16 compute with fp32 masters under sharded data parallelism, where the sharding engine owns the masters.

- FSDP2: keep the sharded parameters in fp32 (they are the masters the optimizer updates) and let FSDP cast the
  unsharded copies to bf16 for forward/backward and reduce gradients in fp32:
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.
- DeepSpeed ZeRO-3: its ``bf16`` mode holds bf16 parameters for compute and fp32 master partitions and moments in the
  optimizer. :func:`deepspeed_zero3_config` writes that config from a preset.
"""

from __future__ import annotations

from typing import Any

import torch

from .presets import OptimizerPreset


def fsdp2_mixed_precision_policy():
    """FSDP2 policy: bf16 unsharded parameters for compute, fp32 gradient reduction, fp32 sharded masters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def deepspeed_zero3_config(preset: OptimizerPreset, offload_optimizer: bool = False) -> dict[str, Any]:
    """A DeepSpeed ZeRO-3 config with bf16 compute, fp32 masters and the preset's AdamW hyperparameters.

    Batch sizes are left to Accelerate/Trainer ("auto"), which fills them from the training arguments.
    """
    zero: dict[str, Any] = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        # Save a consolidated 16-bit model as well (what vLLM and the Hub get); masters stay in the checkpoint.
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
        # fp32 gradient accumulation and reduction: bf16 sums over many micro-batches lose the small RL signal.
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32",
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": preset.learning_rate,
                "betas": [preset.adam_beta1, preset.adam_beta2],
                "eps": preset.adam_epsilon,
                "weight_decay": preset.weight_decay,
            },
        },
        "gradient_clipping": preset.max_grad_norm,
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
    }
