"""How a separate PPO critic is trained across processes: by the same distributed machinery as the policy.

Design (why a second prepared model, not one module holding policy and value head): the policy's module is what TRL
generates from, syncs into vLLM, saves and pushes; a critic inside it would leak into all four (vLLM would be sent a
value model's weights, the Hub a critic). So the separate critic is prepared on its own, next to the policy, the way
OpenRLHF and verl run actor and critic as separate engines:

- one process: the module itself, its optimizer, clipping at ``max_grad_norm``;
- DDP: a ``DistributedDataParallel`` replica: DDP averages the gradients in its backward hooks, so there is no
  hand-written all-reduce;
- DeepSpeed (any ZeRO stage): a DeepSpeed engine of its own, built from the policy's DeepSpeed config (same ZeRO
  stage, precision, gradient accumulation, gradient clipping), so parameters, gradients and Adam states are
  partitioned like the policy's, bf16 compute keeps fp32 masters, and the engine steps at the accumulation boundary;
- FSDP2: ``fully_shard`` on each decoder layer and on the critic, with the policy's FSDP2 options (mixed-precision
  policy, resharding, offload, mesh): parameters (fp32 sharded masters), gradients and Adam states are sharded, the
  gradients reduce-scattered by FSDP, the clipping norm computed over the shards. FSDP1 (Accelerate's
  ``fsdp_version: 1``) keeps a DDP replica, with a warning.

The critic's loss never shares a graph with the policy's (a separate model, integer inputs), so its backward runs on
its own, right after its loss is computed; the same loss scaling as the policy's (``1 / accumulation steps``).

The shared-base critic (an adapter on the policy) is not handled here: its parameters are the policy's, trained by the
policy's optimizer in a group of their own (``PPOTrainer.create_optimizer``).
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from ..generation.weight_sync import unsharded
from .critic import SeparateCritic, critic_state, load_critic_state

logger = logging.getLogger(__name__)

DEEPSPEED_CRITIC_TAG = "critic_deepspeed"  # the critic engine's subfolder of a checkpoint
FSDP2_OPTIMIZER_KEY = "critic_optimizer_fsdp2"  # full Adam state keyed by parameter name (not by index)


@dataclass
class CriticBackend:
    """How the separate critic is wrapped. ``for_accelerator`` reads it off the trainer's Accelerator; a test can
    give it directly (Accelerate runs FSDP only on accelerators, while ``fully_shard`` itself runs on CPU)."""

    kind: str = field(metadata={"help": "'single', 'ddp', 'deepspeed' or 'fsdp2'."})
    num_processes: int = field(default=1, metadata={"help": "Data-parallel processes."})
    device: torch.device = field(default_factory=lambda: torch.device("cpu"), metadata={"help": "This rank's device."})
    deepspeed_config: dict | None = field(
        default=None, metadata={"help": "The policy's DeepSpeed config ('deepspeed'): the critic engine's template."}
    )
    fsdp2_kwargs: dict = field(
        default_factory=dict,
        metadata={"help": "fully_shard's keyword arguments ('fsdp2'): mesh, mp_policy, reshard_after_forward, ..."},
    )

    @classmethod
    def for_accelerator(cls, accelerator: Any) -> CriticBackend:
        from accelerate.utils import DistributedType

        common = {"num_processes": accelerator.num_processes, "device": accelerator.device}
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            return cls("deepspeed", deepspeed_config=accelerator.state.deepspeed_plugin.deepspeed_config, **common)
        if accelerator.distributed_type == DistributedType.FSDP:
            plugin = accelerator.state.fsdp_plugin
            if plugin.fsdp_version == 2:
                return cls("fsdp2", fsdp2_kwargs=_fsdp2_kwargs(plugin, accelerator), **common)
            logger.warning(
                "PPO's separate critic is a DDP replica under FSDP1 (each GPU holds all of it): use fsdp_version: 2 "
                "or DeepSpeed ZeRO-3 to shard it, or critic_mode='shared_base'."
            )
        if accelerator.num_processes > 1:
            return cls("ddp", **common)
        return cls("single", **common)


class DistributedCritic:
    """A ``SeparateCritic`` with its optimizer, wrapped for the backend (see the module docstring).

    Args:
        critic: the critic module (backbone + value head), on the backend's device.
        optimizer: a torch optimizer over ``critic.trainable_parameters()``, not stepped yet (FSDP2 replaces the
            parameters it holds with their shards).
        backend: how to wrap it (``CriticBackend.for_accelerator(accelerator)`` in the trainer).
        max_grad_norm: gradient clipping norm (None or 0: no clipping).
        gradient_accumulation_steps: micro-batches per optimizer step (a DeepSpeed engine counts them itself).
        micro_batch_size: rows per device per micro-batch (DeepSpeed's ``train_micro_batch_size_per_gpu``).
    """

    def __init__(
        self,
        critic: SeparateCritic,
        optimizer: torch.optim.Optimizer,
        backend: CriticBackend,
        max_grad_norm: float | None,
        gradient_accumulation_steps: int,
        micro_batch_size: int,
    ):
        self.critic = critic
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.num_processes = backend.num_processes
        self.backend = backend.kind
        if backend.kind == "deepspeed":
            self.module = _deepspeed_engine(
                critic, optimizer, backend, max_grad_norm, gradient_accumulation_steps, micro_batch_size
            )
        elif backend.kind == "fsdp2":
            self.module = _fully_shard(critic, optimizer, backend.fsdp2_kwargs)
        elif backend.kind == "ddp":
            device_ids = [backend.device.index] if backend.device.type == "cuda" else None
            self.module = nn.parallel.DistributedDataParallel(critic, device_ids=device_ids)
        elif backend.kind == "single":
            self.module = critic
        else:
            raise ValueError(f"Unknown critic backend {backend.kind!r}: use 'single', 'ddp', 'deepspeed' or 'fsdp2'.")

    def values(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """V at every position, through the wrapper (so DDP and ZeRO-3 see the forward)."""
        return self.module(input_ids, attention_mask, position_ids)

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
        # FSDP2: this rank's shard of each gradient (the guard combines the ranks' answers).
        grads = [_local(p.grad) for p in self.trainable_parameters() if p.grad is not None]
        if not grads:
            return True
        return torch.stack([torch.isfinite(g).all() for g in grads]).all()

    def step(self) -> torch.Tensor | None:
        """The optimizer step at the policy's accumulation boundary (a DeepSpeed engine already stepped itself).
        Returns the gradient norm before clipping (None when not clipping, or under DeepSpeed)."""
        if self.backend == "deepspeed":
            return None
        norm = None
        if self.max_grad_norm:
            # FSDP2's gradients are sharded DTensors: the norm is reduced over the shards, the same as unsharded.
            norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), self.max_grad_norm)
            norm = unsharded(norm)
        self.optimizer.step()
        self.zero_grad()
        return norm

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
        state = {"critic": critic_state(self.critic)}  # FSDP2: gathered whole (a collective)
        if self.backend == "fsdp2":
            # The Adam moments gathered whole, keyed by parameter name, on rank 0 (a collective).
            optimizer_state = get_optimizer_state_dict(
                self.critic, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            if is_main_process:
                state[FSDP2_OPTIMIZER_KEY] = optimizer_state
        elif is_main_process:
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
        optimizer_key = FSDP2_OPTIMIZER_KEY if self.backend == "fsdp2" else "critic_optimizer"
        if optimizer_key not in state:
            raise ValueError(
                f"{checkpoint_dir}'s critic optimizer was saved {'without' if self.backend == 'fsdp2' else 'with'} "
                "FSDP2: resume it with the launch config it was saved with."
            )
        load_critic_state(self.critic, state["critic"])  # FSDP2: every rank cuts its shard of the full tensors
        if self.backend == "fsdp2":
            # Every rank read the same full state: each keeps its shard of the moments.
            set_optimizer_state_dict(
                self.critic, self.optimizer, state[optimizer_key], options=StateDictOptions(full_state_dict=True)
            )
        else:
            self.optimizer.load_state_dict(state[optimizer_key])


def _deepspeed_engine(
    critic: SeparateCritic,
    optimizer: torch.optim.Optimizer,
    backend: CriticBackend,
    max_grad_norm: float | None,
    gradient_accumulation_steps: int,
    micro_batch_size: int,
):
    """A DeepSpeed engine for the critic, configured like the policy's (its ZeRO stage, precision and offload)."""
    import deepspeed

    config = copy.deepcopy(backend.deepspeed_config)
    # The critic's optimizer is ours (the ppo_critic preset); the learning-rate schedule stays the policy's affair.
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    config["zero_allow_untested_optimizer"] = True
    config["gradient_clipping"] = float(max_grad_norm or 0.0)
    config["gradient_accumulation_steps"] = gradient_accumulation_steps
    config["train_micro_batch_size_per_gpu"] = micro_batch_size
    config["train_batch_size"] = micro_batch_size * gradient_accumulation_steps * backend.num_processes
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
    # DeepSpeed's flat partitions hold one dtype (ZeRO-3 with bf16 failed in its defragment on the bf16 backbone plus
    # the fp32 value head): the head joins the compute dtype first. The engine's fp32 masters keep its precision.
    if config.get("bf16", {}).get("enabled") is True:
        critic.to(torch.bfloat16)
    elif config.get("fp16", {}).get("enabled") is True:
        critic.to(torch.float16)
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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2); any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _fsdp2_kwargs(plugin: Any, accelerator: Any) -> dict:
    """``fully_shard`` options as Accelerate passes them for the policy (``accelerate.utils.fsdp2_prepare_model``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    kwargs = {
        "reshard_after_forward": plugin.reshard_after_forward,
        "offload_policy": plugin.cpu_offload,  # an OffloadPolicy for FSDP2 (Accelerate's plugin converts a bool)
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
    }
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is not None:
        kwargs["mesh"] = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
    return kwargs


def _fully_shard(critic: SeparateCritic, optimizer: torch.optim.Optimizer, fsdp2_kwargs: dict) -> nn.Module:
    """Shard the critic with FSDP2 (each decoder layer a group, the rest in the root's) and point its optimizer at
    the sharded parameters, which replace the module's own."""
    from torch.distributed.fsdp import fully_shard

    if optimizer.state:
        raise ValueError("The critic's optimizer has stepped already: shard the critic before its first step.")
    names = {id(param): name for name, param in critic.named_parameters()}
    model = critic.model.get_base_model() if hasattr(critic.model, "get_base_model") else critic.model
    # The classes transformers never splits (the decoder layers): one all-gather per layer, as Accelerate wraps them.
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in critic.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, **fsdp2_kwargs)
    fully_shard(critic, **fsdp2_kwargs)
    sharded = dict(critic.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(param)]] for param in group["params"]]
    return critic
