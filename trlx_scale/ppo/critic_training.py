"""How a separate PPO critic is trained across processes: by the same distributed machinery as the policy.

Design (why a second prepared model, not one module holding policy and value head): the policy's module is what TRL
generates from, syncs into vLLM, saves and pushes; a critic inside it would leak into all four (vLLM would be sent a
value model's weights, the Hub a critic). So the separate critic is prepared on its own, next to the policy, the way
OpenRLHF and verl run actor and critic as separate engines:

- one process: the module itself, its optimizer, clipping at ``max_grad_norm``;
- DDP (and FSDP, for now: see ``PPOTrainer``'s docs): a ``DistributedDataParallel`` replica: DDP averages the
  gradients in its backward hooks, so there is no hand-written all-reduce;
- DeepSpeed (any ZeRO stage): a DeepSpeed engine of its own, built from the policy's DeepSpeed config (same ZeRO
  stage, precision, gradient accumulation, gradient clipping), so parameters, gradients and Adam states are
  partitioned like the policy's, bf16 compute keeps fp32 masters, and the engine steps at the accumulation boundary.

The critic's loss never shares a graph with the policy's (a separate model, integer inputs), so its backward runs on
its own, right after its loss is computed; the same loss scaling as the policy's (``1 / accumulation steps``).

The shared-base critic (an adapter on the policy) is not handled here: its parameters are the policy's, trained by the
policy's optimizer in a group of their own (``PPOTrainer.create_optimizer``).
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import torch
from torch import nn

from .critic import SeparateCritic, critic_state, load_critic_state

logger = logging.getLogger(__name__)

DEEPSPEED_CRITIC_TAG = "critic_deepspeed"  # the critic engine's subfolder of a checkpoint


class DistributedCritic:
    """A ``SeparateCritic`` with its optimizer, wrapped for the accelerator's backend (see the module docstring).

    Args:
        critic: the critic module (backbone + value head), on the accelerator's device.
        optimizer: a torch optimizer over ``critic.trainable_parameters()``.
        accelerator: the trainer's Accelerator (its distributed type and DeepSpeed config decide the wrapping).
        max_grad_norm: gradient clipping norm (None or 0: no clipping).
        gradient_accumulation_steps: micro-batches per optimizer step (a DeepSpeed engine counts them itself).
        micro_batch_size: rows per device per micro-batch (DeepSpeed's ``train_micro_batch_size_per_gpu``).
    """

    def __init__(
        self,
        critic: SeparateCritic,
        optimizer: torch.optim.Optimizer,
        accelerator: Any,
        max_grad_norm: float | None,
        gradient_accumulation_steps: int,
        micro_batch_size: int,
    ):
        from accelerate.utils import DistributedType

        self.critic = critic
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.num_processes = accelerator.num_processes
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            self.backend = "deepspeed"
            self.module = _deepspeed_engine(
                critic, optimizer, accelerator, max_grad_norm, gradient_accumulation_steps, micro_batch_size
            )
        elif accelerator.num_processes > 1:
            if accelerator.distributed_type == DistributedType.FSDP:
                logger.warning(
                    "PPO's separate critic is a DDP replica under FSDP in this version (not sharded): each GPU holds "
                    "all of it. DeepSpeed ZeRO-3 shards it, or use critic_mode='shared_base'."
                )
            self.backend = "ddp"
            device_ids = [accelerator.device.index] if accelerator.device.type == "cuda" else None
            self.module = nn.parallel.DistributedDataParallel(critic, device_ids=device_ids)
        else:
            self.backend = "single"
            self.module = critic

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """V at every position, through the wrapper (so DDP and ZeRO-3 see the forward)."""
        return self.module(input_ids, attention_mask)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return self.critic.trainable_parameters()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the critic's loss, already scaled for gradient accumulation like the policy's."""
        if self.backend == "deepspeed":
            self.module.backward(loss, scale_wrt_gas=False)
            # DeepSpeed counts micro-steps in step(): called after every backward, it steps (with clipping) only at
            # the accumulation boundary, as Accelerate does for the policy's engine.
            self.module.step()
        else:
            loss.backward()

    def gradients_finite(self) -> torch.Tensor | bool:
        """Whether this rank's critic gradients are all finite (DeepSpeed keeps them partitioned: not seen here)."""
        if self.backend == "deepspeed":
            return True
        grads = [p.grad for p in self.trainable_parameters() if p.grad is not None]
        if not grads:
            return True
        return torch.stack([torch.isfinite(g).all() for g in grads]).all()

    def step(self) -> None:
        """The optimizer step at the policy's accumulation boundary (a DeepSpeed engine already stepped itself)."""
        if self.backend == "deepspeed":
            return
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        if self.backend == "deepspeed":
            return  # the engine zeroes its partitioned gradients itself after its step
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ checkpoints

    def save(self, checkpoint_dir: str, is_main_process: bool) -> dict[str, Any]:
        """Everything to resume the critic. DeepSpeed: every rank writes its partitions under
        ``DEEPSPEED_CRITIC_TAG`` (a collective); else rank 0's replica is everyone's, returned to be saved."""
        if self.backend == "deepspeed":
            # save_latest=False: the policy's engine owns the checkpoint's "latest" file.
            self.module.save_checkpoint(checkpoint_dir, tag=DEEPSPEED_CRITIC_TAG, save_latest=False)
            return {"critic_deepspeed": DEEPSPEED_CRITIC_TAG}
        state = {"critic": critic_state(self.critic)}
        if is_main_process:
            state["critic_optimizer"] = self.optimizer.state_dict()
        return state

    def load(self, checkpoint_dir: str, state: dict[str, Any]) -> None:
        if self.backend == "deepspeed":
            tag = state.get("critic_deepspeed")
            if tag is None or not os.path.isdir(os.path.join(checkpoint_dir, tag)):
                raise ValueError(
                    f"{checkpoint_dir} holds no DeepSpeed critic ({DEEPSPEED_CRITIC_TAG}/): it was saved by a run "
                    "without DeepSpeed; resume it with the launch config it was saved with."
                )
            self.module.load_checkpoint(
                checkpoint_dir, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
            )
            return
        if "critic" not in state:
            raise ValueError(
                f"{checkpoint_dir} holds a DeepSpeed critic: resume it with the DeepSpeed launch config it was saved "
                "with."
            )
        load_critic_state(self.critic, state["critic"])
        self.optimizer.load_state_dict(state["critic_optimizer"])


def _deepspeed_engine(
    critic: SeparateCritic,
    optimizer: torch.optim.Optimizer,
    accelerator: Any,
    max_grad_norm: float | None,
    gradient_accumulation_steps: int,
    micro_batch_size: int,
):
    """A DeepSpeed engine for the critic, configured like the policy's (its ZeRO stage, precision and offload)."""
    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    # The critic's optimizer is ours (the ppo_critic preset); the learning-rate schedule stays the policy's affair.
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    config["zero_allow_untested_optimizer"] = True
    config["gradient_clipping"] = float(max_grad_norm or 0.0)
    config["gradient_accumulation_steps"] = gradient_accumulation_steps
    config["train_micro_batch_size_per_gpu"] = micro_batch_size
    config["train_batch_size"] = micro_batch_size * gradient_accumulation_steps * accelerator.num_processes
    hidden_size = critic.head.summary.in_features
    zero = config.setdefault("zero_optimization", {})
    # The hidden-size-based buckets transformers fills for the policy's "auto" values.
    for key, value in (
        ("reduce_bucket_size", hidden_size * hidden_size),
        ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
        ("stage3_param_persistence_threshold", 10 * hidden_size),
    ):
        if zero.get(key, "auto") == "auto":
            zero[key] = value
    leftover = _auto_values(config)
    if leftover:
        raise ValueError(
            f"The DeepSpeed config still has 'auto' values the critic's engine cannot fill: {leftover}. Give them "
            "numbers in the DeepSpeed config."
        )
    engine, *_ = deepspeed.initialize(model=critic, optimizer=optimizer, config=config)
    return engine


def _auto_values(config: dict, prefix: str = "") -> list[str]:
    found = []
    for key, value in config.items():
        if isinstance(value, dict):
            found += _auto_values(value, f"{prefix}{key}.")
        elif value == "auto":
            found.append(f"{prefix}{key}")
    return found
