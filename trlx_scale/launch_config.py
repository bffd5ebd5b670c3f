"""Accelerate launch configs for N nodes x G GPUs (DDP, FSDP2, DeepSpeed ZeRO-3), checked before a job starts.

``trlx-scale accelerate-config`` (see ``trlx_scale.cli``) writes them; the YAMLs in ``configs/accelerate/`` were
written by it (a test regenerates and compares them). Every setting a trlx_scale run relies on is here:

- bf16 compute everywhere; the fp32 masters live in the optimizer (DDP: ``FP32MasterAdamW``), in FSDP2's fp32
  sharded parameters, or in DeepSpeed's bf16 optimizer (``docs/optimizers.md``).
- colocated vLLM: one engine per GPU, or per tensor-parallel group inside a node, so the TP size must divide the
  GPUs of a node;
- GRPO: the global generation batch must hold whole groups of ``num_generations`` completions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BACKENDS = ("ddp", "fsdp2", "zero2", "zero3")
MAIN_NODE_IP_PLACEHOLDER = "MAIN_NODE_IP"  # replaced per cluster; the Slurm script fills it from the node list

# Comments written next to the keys of a generated YAML.
KEY_COMMENTS = {
    "distributed_type": "DDP: MULTI_GPU; FSDP2: FSDP; ZeRO-2/3: DEEPSPEED",
    "num_processes": "total training processes over all nodes = nodes x GPUs per node (one vLLM engine per GPU)",
    "num_machines": "nodes",
    "machine_rank": "SET PER NODE: 0 on the main node, 1..N-1 on the others (Slurm: $SLURM_NODEID)",
    "main_process_ip": "SET: address of the node with machine_rank 0, reachable from all nodes",
    "main_process_port": "free TCP port on the main node",
    "rdzv_backend": "static: ranks from machine_rank; c10d for elastic launchers",
    "mixed_precision": "bf16 compute; fp32 masters stay in the optimizer / sharded params (docs/optimizers.md)",
    "fsdp_version": "FSDP2 (per-parameter DTensor sharding)",
    "fsdp_offload_params": "CPU offload of parameters, gradients and optimizer states",
    "fsdp_state_dict_type": "SHARDED: checkpoints are per-rank DCP shards (resumable at another world size); "
    "save_model and the Hub push still write consolidated weights (trlx_scale)",
    "fsdp_reshard_after_forward": "free gathered parameters after forward (ZeRO-3-like memory)",
    "fsdp_cpu_ram_efficient_loading": "only rank 0 reads the checkpoint, others receive it by broadcast",
    "fsdp_activation_checkpointing": "off here: use the trainer's gradient_checkpointing, which TRL manages",
    "fsdp_auto_wrap_policy": "one FSDP unit per decoder layer",
    "zero_stage": "3: parameters, gradients and optimizer states sharded; 2: gradients and optimizer states",
    "offload_optimizer_device": "cpu: Adam states in host RAM (slower steps, much less GPU memory)",
    "offload_param_device": "parameters stay on GPU (vLLM colocated needs them there for weight sync)",
    "zero3_init_flag": "construct the model already partitioned",
    "zero3_save_16bit_model": "save_model gathers consolidated 16-bit weights",
    "deepspeed_multinode_launcher": "standard: accelerate launch on every node (no pdsh/hostfile)",
}


@dataclass
class LaunchPlan:
    """What a job runs on and how it shards; ``validate()`` says what to change when it cannot work."""

    nodes: int = 1
    gpus_per_node: int = 8
    backend: str = "ddp"
    offload: bool = False
    vllm_tensor_parallel_size: int = 1
    per_device_train_batch_size: int = 8
    num_generations: int = 8
    gradient_accumulation_steps: int = 1
    main_process_ip: str = MAIN_NODE_IP_PLACEHOLDER
    main_process_port: int = 29500
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def validate(self) -> None:
        self.notes = []
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"nodes ({self.nodes}) and gpus_per_node ({self.gpus_per_node}) must be at least 1.")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}.")
        if self.offload and self.backend == "ddp":
            raise ValueError("offload needs a sharded backend: use --backend fsdp2, zero2 or zero3.")
        tp = self.vllm_tensor_parallel_size
        if tp < 1 or self.gpus_per_node % tp != 0:
            raise ValueError(
                f"vllm_tensor_parallel_size ({tp}) must divide gpus_per_node ({self.gpus_per_node}): a colocated "
                f"engine's tensor-parallel group stays inside one node. Use one of "
                f"{[d for d in range(1, self.gpus_per_node + 1) if self.gpus_per_node % d == 0]}."
            )
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations must be at least 2 (GRPO compares samples), got {self.num_generations}."
            )
        generation_batch = self.per_device_train_batch_size * self.world_size * self.gradient_accumulation_steps
        if generation_batch % self.num_generations != 0:
            raise ValueError(
                f"The generation batch (per_device_train_batch_size {self.per_device_train_batch_size} x "
                f"{self.world_size} processes x gradient_accumulation_steps {self.gradient_accumulation_steps} = "
                f"{generation_batch}) must be a multiple of num_generations ({self.num_generations}) so that every "
                "prompt's group is complete; change per_device_train_batch_size or num_generations."
            )
        if self.nodes > 1 and self.main_process_ip == MAIN_NODE_IP_PLACEHOLDER:
            self.notes.append(f"set main_process_ip (now {MAIN_NODE_IP_PLACEHOLDER}) and machine_rank on each node")

    def accelerate_config(self) -> dict[str, Any]:
        """The Accelerate config dict (what ``accelerate config`` would write)."""
        self.validate()
        config: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE"}
        if self.backend == "ddp":
            config["distributed_type"] = "MULTI_GPU" if self.world_size > 1 else "NO"
        elif self.backend == "fsdp2":
            config["distributed_type"] = "FSDP"
            config["fsdp_config"] = {
                "fsdp_version": 2,
                "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "fsdp_cpu_ram_efficient_loading": True,
                "fsdp_offload_params": self.offload,
                "fsdp_reshard_after_forward": True,
                # Each rank writes its own shards: FULL_STATE_DICT would gather the whole model and optimizer on rank 0
                # at every save (docs/reliability.md, "Sharded and asynchronous checkpoints").
                "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                "fsdp_activation_checkpointing": False,
            }
        else:
            config["distributed_type"] = "DEEPSPEED"
            stage3 = self.backend == "zero3"
            config["deepspeed_config"] = {
                "zero_stage": 3 if stage3 else 2,
                "offload_optimizer_device": "cpu" if self.offload else "none",
                "offload_param_device": "none",
                # ZeRO-2 keeps whole parameters on every GPU: nothing to construct partitioned or to gather on save.
                "zero3_init_flag": stage3,
                "zero3_save_16bit_model": stage3,
                "gradient_clipping": 1.0,
            }
            if self.nodes > 1:
                config["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
        config.update(
            {
                "mixed_precision": "bf16",
                "num_machines": self.nodes,
                "num_processes": self.world_size,
                "machine_rank": 0,
                "main_training_function": "main",
                "use_cpu": False,
                "downcast_bf16": "no",
                "same_network": True,
                "rdzv_backend": "static",
            }
        )
        if self.world_size > 1 or self.nodes > 1:
            config["gpu_ids"] = "all"
        if self.nodes > 1:
            config["main_process_ip"] = self.main_process_ip
            config["main_process_port"] = self.main_process_port
        return config

    def to_yaml(self) -> str:
        """The config as commented YAML."""
        config = self.accelerate_config()
        header = [
            f"# trlx_scale: {self.nodes} node(s) x {self.gpus_per_node} GPU(s), {self.backend}"
            + (" + CPU offload" if self.offload else "")
            + f", vLLM tensor parallel {self.vllm_tensor_parallel_size}",
            f"# {self.world_size // self.vllm_tensor_parallel_size} colocated vLLM engine(s): each GPU runs one training "
            f"process, and every {self.vllm_tensor_parallel_size} GPU(s) of a node share one engine.",
            "# Written by `trlx-scale accelerate-config` (trlx_scale/launch_config.py). Launch on every node:",
            "#   accelerate launch --config_file <this file> [--machine_rank N] examples/grpo.py",
        ]
        header += [f"# NOTE: {note}" for note in self.notes]
        return "\n".join(header + _yaml_lines(config, indent=0)) + "\n"


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and value in ("no", "NO", "none", "yes", "all"):
        return f'"{value}"'  # YAML 1.1 would read some of these as booleans
    return str(value)


def _yaml_lines(mapping: dict[str, Any], indent: int) -> list[str]:
    lines = []
    for key, value in mapping.items():
        pad = " " * indent
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            lines += _yaml_lines(value, indent + 2)
            continue
        text = f"{pad}{key}: {_scalar(value)}"
        comment = KEY_COMMENTS.get(key)
        lines.append(f"{text:<44} # {comment}" if comment else text)
    return lines


# The configs shipped in configs/accelerate/ (file name -> plan).
SHIPPED_CONFIGS: dict[str, LaunchPlan] = {
    "single_gpu.yaml": LaunchPlan(nodes=1, gpus_per_node=1, backend="ddp"),
    "ddp.yaml": LaunchPlan(nodes=1, gpus_per_node=8, backend="ddp"),
    "fsdp2.yaml": LaunchPlan(nodes=1, gpus_per_node=8, backend="fsdp2"),
    "fsdp2_offload.yaml": LaunchPlan(nodes=1, gpus_per_node=8, backend="fsdp2", offload=True),
    "zero2.yaml": LaunchPlan(nodes=1, gpus_per_node=8, backend="zero2"),
    "zero3.yaml": LaunchPlan(nodes=1, gpus_per_node=8, backend="zero3"),
    "zero3_offload.yaml": LaunchPlan(nodes=1, gpus_per_node=8, backend="zero3", offload=True),
    "multinode_fsdp2.yaml": LaunchPlan(nodes=2, gpus_per_node=8, backend="fsdp2"),
    "multinode_zero3.yaml": LaunchPlan(nodes=2, gpus_per_node=8, backend="zero3"),
}
