"""Per-GPU memory of every role of an RL / preference-learning run, by backend. Pure arithmetic, no GPU needed.

A run is what is trained (``RunSpec``: algorithm, LoRA or full, lengths, batch, precision, engine) on a layout
(``Layout``: backend, offload, GPUs). ``role_memory(run, layout)`` returns one ``RoleMemory`` per role with the
bytes it holds on each GPU and in host RAM, and ``phase_peaks`` adds them up for the two phases of a step (the
colocated engine generating; the trainer's forward/backward) whose larger sum is the GPU's peak.

Formulas (N = data-parallel GPUs; P = parameters; T = trainable parameters (P, or the adapter for LoRA)):

- Training state per trainable parameter (Rajbhandari et al. 2020, "ZeRO", section 3: 2 + 2 + 12 = 16 bytes for
  mixed-precision Adam): ``bf16-master`` 2 (bf16 weights) + 2 (bf16 gradients) + 4 (fp32 master) + 8 (fp32 Adam
  m and v); ``fp32`` 4 + 4 + 8; ``bf16`` (no masters, bf16 moments) 2 + 2 + 4. Under FSDP2 the fp32 masters are the
  sharded parameters themselves (MixedPrecisionPolicy), so weights count 4 and masters 0: the same 16 bytes.
- Sharding (ZeRO stages 1-3; FSDP2 = stage 3): DDP replicates weights, gradients and optimizer state; ZeRO-2 shards
  gradients and optimizer state by N; ZeRO-3 and FSDP2 shard all three by N and gather, per GPU, the layer being
  computed and the one prefetched, plus the largest single tensor (the embedding), in the compute dtype.
- Offload: ZeRO-2/3 ``offload_optimizer`` moves the fp32 masters and Adam moments to host RAM (Ren et al. 2021,
  "ZeRO-Offload"); FSDP2 ``offload_params`` moves parameters, gradients and optimizer state to host RAM.
- Activations per decoder layer and token, compute dtype, flash attention (no s^2 score matrix; Dao et al. 2022):
  attention block 2h (norm in/out) + 2ad (Q, attention output) + 2kd (K, V); SwiGLU MLP 2h + 4f (gate, up,
  SiLU(gate), product); i.e. 4h + 2ad + 2kd + 4f values, which for a GPT-shaped layer (k = a, ad = h, f = 4h) is
  24h -- the 34sbh bytes of Korthikanti et al. 2022 ("Reducing Activation Recomputation", eq. 2) less its dropout
  masks and softmax. With gradient checkpointing only each layer's input (h values) is kept, plus one layer's full
  activations while it is recomputed (Chen et al. 2016); with packed passes under ``max_tokens_per_microbatch``
  that layer is recomputed for one forward's tokens (the budget, or the longest sample if longer), not the
  micro-batch's; with ``recompute_forwards`` as well, each forward is recomputed in the backward, so the kept
  activations and logits are one forward's, not the micro-batch's (TRL's loss spans it). The LM head adds, for the scored tokens, the logits in the
  compute dtype plus the fp32 log-softmax and its gradient: V x (bytes + 8) per token.
- Colocated vLLM engine (Kwon et al. 2023): awake, it takes ``gpu_memory_utilization`` of the GPU (its weights,
  in its dtype and split by tensor parallelism, and the KV cache in what is left). KV cache per token:
  2 x layers x KV heads x head_dim x bytes. Asleep (``enable_sleep_mode``), level 1 moves its weights to host RAM
  and drops the KV cache; level 2 drops both, so during training it holds (almost) nothing on the GPU. Without
  sleep mode it keeps its share during training too. On CPU the KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB.
- Roles as trlx_scale builds them: references and reward models are prepared as TRL prepares them (sharded under
  ZeRO-3/FSDP2), PPO's included. PPO's separate critic is trained by the policy's machinery: under DeepSpeed a
  second engine from the policy's config, under FSDP2 ``fully_shard`` with the policy's options (sharded and in the
  policy's precision, like it); under DDP an fp32 replica on every GPU with an fp32 AdamW (16 bytes per parameter).
  A LoRA policy's reference is its own base (adapters disabled: nothing extra); ``shared_base`` puts the critic's
  adapter and value head on the policy's base, in the policy's optimizer.
- Runtime: the CUDA context, NCCL buffers and allocator fragmentation (plus vLLM's CUDA graphs when colocated)
  are a flat ``runtime_overhead_gib`` per GPU: a margin (default 2 GiB), not a derivation; set it from
  ``nvidia-smi`` on your cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .model_shape import ALL_LINEAR, ModelShape

GIB = 2**30
ALGORITHMS = ("grpo", "ppo", "dpo", "online-dpo")
PLAN_BACKENDS = ("ddp", "zero2", "zero3", "fsdp2")
PRECISIONS = ("bf16-master", "fp32", "bf16")

# (weights, gradients, masters, moments) bytes per trainable parameter.
STATE_BYTES = {"bf16-master": (2, 2, 4, 8), "fp32": (4, 4, 0, 8), "bf16": (2, 2, 0, 4)}
COMPUTE_BYTES = {"bf16-master": 2, "fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class RunSpec:
    """What is trained: the model, the algorithm and its roles, lengths and batch, precision, the engine."""

    model: ModelShape
    algo: str = "grpo"
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = ALL_LINEAR
    critic_mode: str = "separate"
    critic_lora: bool = False
    reference: bool | None = None  # None: the algorithm's default (GRPO: only with a KL term, i.e. --beta > 0)
    reward_model: ModelShape | None = None
    prompt_length: int = 512
    completion_length: int = 512
    micro_batch: int = 4
    generation_batch: int | None = None  # sequences one engine generates per rollout; None: micro_batch
    num_generations: int = 8
    gradient_checkpointing: bool = True
    precision: str = "bf16-master"
    vllm: bool = True
    vllm_gpu_memory_utilization: float = 0.3
    vllm_kv_cache_gib: float | None = None  # explicit KV cache (the CPU engine's VLLM_CPU_KVCACHE_SPACE)
    vllm_dtype_bytes: int = 2
    vllm_tensor_parallel_size: int = 1
    vllm_sleep: bool = True
    vllm_sleep_level: int | None = None  # None: 1 for LoRA (base kept in host RAM), 2 for full fine-tuning
    vllm_runtime_gib: float = 0.0  # the engine's own memory beyond weights and KV (only with vllm_kv_cache_gib)
    runtime_overhead_gib: float = 2.0
    trainable_params: int | None = None  # counted by a live trainer (else: all, or the LoRA formula)
    compute_bytes: int | None = None  # activation dtype (else: by precision)
    zero3_init: bool = True  # ZeRO-3 builds the model partitioned (zero3_init_flag); off: each rank loads it whole
    # Packed (padding-free) passes: the most tokens of one forward (max_tokens_per_microbatch); None: one forward
    # per micro-batch (padded, or packed without a budget).
    max_tokens_per_microbatch: int | None = None
    # recompute_forwards: the packed forwards recomputed in the backward ("auto"/"true": where the budget is set and
    # the backend allows it, recomputes_forwards; "false": every forward's graph kept until the backward).
    recompute_forwards: str = "auto"

    def validate(self) -> None:
        if self.algo not in ALGORITHMS:
            raise ValueError(f"--algo must be one of {', '.join(ALGORITHMS)}, got {self.algo!r}.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}.")
        if self.critic_mode not in ("separate", "shared_base"):
            raise ValueError(f"--critic-mode must be 'separate' or 'shared_base', got {self.critic_mode!r}.")
        if self.algo == "ppo" and self.critic_mode == "shared_base" and not (self.lora_rank or self.trainable_params):
            raise ValueError("--critic-mode shared_base puts the critic on the policy's LoRA base: add --lora-rank.")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError(f"--lora-rank must be a positive integer, got {self.lora_rank}.")
        for name in ("prompt_length", "completion_length", "micro_batch", "num_generations"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be a positive integer, got {getattr(self, name)}.")
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise ValueError(
                f"--max-tokens-per-microbatch must be a positive number of tokens, got {self.max_tokens_per_microbatch}."
            )
        if self.recompute_forwards not in ("auto", "true", "false"):
            raise ValueError(
                f"--recompute-forwards must be 'auto', 'true' or 'false', got {self.recompute_forwards!r}."
            )
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(
                f"--vllm-gpu-memory-utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization}."
            )

    @property
    def uses_engine(self) -> bool:
        return self.vllm

    @property
    def has_reference(self) -> bool:
        if self.reference is not None:
            return self.reference
        return self.algo in ("ppo", "dpo", "online-dpo")

    @property
    def sleep_level(self) -> int:
        return self.vllm_sleep_level or (1 if self.lora_rank else 2)


@dataclass(frozen=True)
class Layout:
    """Where it runs: the backend, offload, and the GPUs (all of them data-parallel training processes)."""

    backend: str = "ddp"
    offload: bool = False
    nodes: int = 1
    gpus_per_node: int = 8

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def validate(self) -> None:
        if self.backend not in PLAN_BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(PLAN_BACKENDS)}, got {self.backend!r}.")
        if self.offload and self.backend == "ddp":
            raise ValueError("--offload needs a sharded backend (zero2, zero3 or fsdp2); DDP cannot offload.")
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"--nodes ({self.nodes}) and --gpus-per-node ({self.gpus_per_node}) must be >= 1.")


@dataclass
class RoleMemory:
    """Bytes one role holds per GPU (split by phase) and in host RAM per GPU process; ``formula`` says why."""

    role: str
    training: float = 0.0  # on the GPU while the trainer runs forward/backward/step
    generation: float = 0.0  # on the GPU while the colocated engine generates
    host: float = 0.0
    formula: str = ""

    @property
    def peak(self) -> float:
        return max(self.training, self.generation)


@dataclass
class Plan:
    """One layout's verdict: roles, the two phase sums, the peak against the GPU's memory."""

    layout: Layout
    roles: list[RoleMemory]
    gpu_memory_gib: float
    notes: list[str] = field(default_factory=list)
    blockers: list[str] = field(default_factory=list)  # reasons it cannot start, whatever the memory sum

    @property
    def training_gib(self) -> float:
        return sum(r.training for r in self.roles) / GIB

    @property
    def generation_gib(self) -> float:
        return sum(r.generation for r in self.roles) / GIB

    @property
    def per_gpu_gib(self) -> float:
        return max(self.training_gib, self.generation_gib)

    @property
    def host_gib(self) -> float:
        return sum(r.host for r in self.roles) / GIB

    @property
    def headroom_gib(self) -> float:
        return self.gpu_memory_gib - self.per_gpu_gib

    @property
    def fits(self) -> bool:
        return self.headroom_gib >= 0 and not self.blockers

    def as_dict(self) -> dict:
        return {
            "backend": self.layout.backend,
            "offload": self.layout.offload,
            "nodes": self.layout.nodes,
            "gpus_per_node": self.layout.gpus_per_node,
            "gpus": self.layout.gpus,
            "fits": self.fits,
            "per_gpu_gib": round(self.per_gpu_gib, 3),
            "training_phase_gib": round(self.training_gib, 3),
            "generation_phase_gib": round(self.generation_gib, 3),
            "headroom_gib": round(self.headroom_gib, 3),
            "host_per_gpu_gib": round(self.host_gib, 3),
            "roles": {
                r.role: {
                    "training_gib": round(r.training / GIB, 3),
                    "generation_gib": round(r.generation / GIB, 3),
                    "host_gib": round(r.host / GIB, 3),
                    "formula": r.formula,
                }
                for r in self.roles
            },
            "notes": list(self.notes),
            "blockers": list(self.blockers),
        }


def _n(count: float) -> str:
    """A parameter count as people write it: 40.0M, 6.74B."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.3g}{unit}"
    return f"{count:.0f}"


# ---------------------------------------------------------------------------------------------- the parts
def state_bytes_per_param(precision: str, backend: str) -> tuple[int, int, int, int]:
    """(weights, gradients, masters, moments) bytes per trainable parameter as the backend stores them."""
    weights, grads, masters, moments = STATE_BYTES[precision]
    if backend == "fsdp2" and masters:
        # MixedPrecisionPolicy: the sharded fp32 parameters are the masters, gradients are reduced and kept in fp32.
        return masters, 4, 0, moments  # no persistent bf16 copy: bf16 exists only while gathered
    if backend in ("zero2", "zero3") and not masters:
        # DeepSpeed's ZeRO optimizer always keeps an fp32 flat copy of its partition (fp32_partitioned_groups_flat),
        # also when the model itself is fp32.
        return weights, grads, 4, moments
    return weights, grads, masters, moments


def critic_sharded(backend: str) -> bool:
    """Whether PPO's separate critic is sharded like the policy: under DeepSpeed (its own engine from the policy's
    config) and FSDP2 (``fully_shard`` with the policy's options); under DDP it is a replica by definition."""
    return backend in ("zero2", "zero3", "fsdp2")


def shard_divisors(backend: str, gpus: int) -> tuple[int, int]:
    """(weights, gradients and optimizer state) are split over this many GPUs: ZeRO-3/FSDP2 shard all three,
    ZeRO-2 the last two, DDP nothing."""
    return (gpus if backend in ("zero3", "fsdp2") else 1), (1 if backend == "ddp" else gpus)


def training_state(
    params: float, precision: str, backend: str, offload: bool, gpus: int
) -> dict[str, tuple[float, float]]:
    """{part: (GPU bytes, host bytes)} for `params` trainable parameters under a backend."""
    weights, grads, masters, moments = state_bytes_per_param(precision, backend)
    shard_weights, shard_rest = shard_divisors(backend, gpus)
    parts = {
        "weights": params * weights / shard_weights,
        "gradients": params * grads / shard_rest,
        "optimizer": params * (masters + moments) / shard_rest,
    }
    on_host = set()
    if offload and backend in ("zero2", "zero3"):
        on_host = {"optimizer"}
    elif offload and backend == "fsdp2":
        on_host = {"weights", "gradients", "optimizer"}
    return {name: ((0.0, value) if name in on_host else (value, 0.0)) for name, value in parts.items()}


def forward_tokens(tokens: int, seq_len: int, max_tokens_per_microbatch: int | None) -> int:
    """The most tokens one forward of a micro-batch of ``tokens`` runs: all of them, or under a packed pass's token
    budget the budget (a sample longer than it gets a forward of its own, so never below ``seq_len``)."""
    if max_tokens_per_microbatch is None:
        return tokens
    return min(tokens, max(max_tokens_per_microbatch, seq_len))


def activation_bytes(
    model: ModelShape,
    sequences: int,
    seq_len: int,
    scored_tokens: int,
    compute_bytes: int,
    checkpointing: bool,
    max_tokens_per_microbatch: int | None = None,
    recompute_forwards: bool = False,
) -> float:
    """Activations kept for backward by one micro-batch, plus the LM head's logits for the scored tokens.

    ``max_tokens_per_microbatch`` (packed passes) bounds one forward. Alone it bounds the layer recomputed under
    gradient checkpointing (the backward recomputes one layer of one forward at a time), not what the micro-batch
    keeps: TRL's loss spans the micro-batch, so every forward's activations and logits live until its one backward.
    With ``recompute_forwards`` the micro-batch keeps only each scored token's log-prob and entropy (fp32) and the
    backward holds one forward's graph at a time: the budget bounds the layers' activations and the logits."""
    h, d = model.hidden, model.dim
    f = (model.intermediate or 0) * model.experts_per_token
    per_token_layer = 4 * h + 2 * model.heads * d + 2 * model.kv * d + 4 * f
    tokens = sequences * seq_len
    forward = forward_tokens(tokens, seq_len, max_tokens_per_microbatch)
    recomputing = recompute_forwards and forward < tokens  # one forward: nothing to recompute (as the trainer)
    held = forward if recomputing else tokens  # the tokens whose graph is alive at once
    if checkpointing:
        layers = model.layers * held * h + forward * per_token_layer
    else:
        layers = model.layers * held * per_token_layer
    scored = sequences * scored_tokens
    logits = scored * held / tokens * model.vocab * (compute_bytes + 8)
    outputs = scored * 8 if recomputing else 0  # the forwards' log-probs and entropies, kept for the loss
    return layers * compute_bytes + logits + outputs


def recomputes_forwards(run: RunSpec, backend: str) -> bool:
    """Whether the trainer recomputes its packed forwards (``recompute_forwards``) in this run: 'auto' and 'true'
    where a budget is set, except under ZeRO-3, where the trainer refuses it (see the field)."""
    if run.recompute_forwards == "false" or run.max_tokens_per_microbatch is None:
        return False
    return backend != "zero3"


# DeepSpeed's default `stage3_max_live_parameters` (DeepSpeed config docs): parameters it keeps gathered at once.
ZERO3_MAX_LIVE_PARAMETERS = 1e9


def gathered_working_set(model: ModelShape, compute_bytes: int, backend: str) -> float:
    """Parameters gathered whole during a forward/backward of a sharded model.

    FSDP2 (reshard_after_forward): the layer being computed and the one prefetched, plus the largest tensor.
    ZeRO-3: DeepSpeed releases a gathered parameter only beyond `stage3_max_live_parameters` (default 1e9) or its
    reuse distance (default 1e9), so up to min(P, 1e9) parameters stay gathered.
    """
    if backend == "zero3":
        return min(model.total_params, ZERO3_MAX_LIVE_PARAMETERS) * compute_bytes
    return (2 * model.layer_params + model.largest_param) * compute_bytes


def frozen_copy(params: float, dtype_bytes: int, backend: str, gpus: int, sharded_like_policy: bool) -> float:
    """A frozen model (reference, reward): sharded under ZeRO-3/FSDP2 when prepared like the policy, else a replica."""
    shard = gpus if sharded_like_policy and backend in ("zero3", "fsdp2") else 1
    return params * dtype_bytes / shard


# ---------------------------------------------------------------------------------------------- the roles
def role_memory(run: RunSpec, layout: Layout, gpu_memory_gib: float) -> Plan:
    """Every role's bytes per GPU for `run` on `layout` (see the module docstring for each formula)."""
    run.validate()
    layout.validate()
    model, gpus, backend = run.model.complete(), layout.gpus, layout.backend
    compute = run.compute_bytes or COMPUTE_BYTES[run.precision]
    total = model.total_params
    if run.trainable_params is not None:
        trainable = run.trainable_params
    else:
        trainable = model.lora_params(run.lora_rank, run.lora_targets) if run.lora_rank else total
    lora = trainable < total
    shard_all, shard_rest = shard_divisors(backend, gpus)
    roles: list[RoleMemory] = []
    notes: list[str] = []
    blockers: list[str] = []

    def add(role: str, training: float, generation: float | None = None, host: float = 0.0, formula: str = ""):
        roles.append(RoleMemory(role, training, training if generation is None else generation, host, formula))

    # Policy: frozen base (LoRA) + trainable state.
    if lora:
        base = total * compute / shard_all
        add("policy base (frozen)", base, formula=f"{_n(total)} params x {compute} B / {shard_all}")
    state = training_state(trainable, run.precision, backend, layout.offload, gpus)
    w_gpu, w_host = state["weights"]
    g_gpu, g_host = state["gradients"]
    o_gpu, o_host = state["optimizer"]
    label = "policy adapter" if lora else "policy"
    wb, gb, mb, ob = state_bytes_per_param(run.precision, backend)
    add(f"{label} weights", w_gpu, host=w_host, formula=f"{_n(trainable)} trainable x {wb} B / {shard_all}")
    # Gradients exist from the first backward to the optimizer step (zero_grad(set_to_none=True) frees them).
    add(f"{label} gradients", g_gpu, generation=0.0, host=g_host, formula=f"{_n(trainable)} x {gb} B / {shard_rest}")
    add(
        f"{label} optimizer",
        o_gpu,
        host=o_host,
        formula=f"{_n(trainable)} x ({mb} B masters + {ob} B Adam moments) / {shard_rest}"
        + (", offloaded to host" if o_host else ""),
    )

    # Activations of the largest pass (policy loss; DPO: chosen + rejected in one batch).
    seq_len = run.prompt_length + run.completion_length
    if run.algo in ("dpo", "online-dpo"):
        sequences, scored = 2 * run.micro_batch, seq_len
    else:
        sequences, scored = run.micro_batch, run.completion_length
    budget = run.max_tokens_per_microbatch
    recompute = recomputes_forwards(run, backend)
    act = activation_bytes(model, sequences, seq_len, scored, compute, run.gradient_checkpointing, budget, recompute)
    forward = forward_tokens(sequences * seq_len, seq_len, budget)
    if recompute:
        how = f", forwards of {forward} tokens recomputed one at a time" + (
            " (layers checkpointed)" if run.gradient_checkpointing else ""
        )
    elif run.gradient_checkpointing:
        how = f", checkpointed (one layer of {forward} tokens recomputed)" if budget else ", checkpointed"
    else:
        how = ", no checkpointing"
    add("activations", act, generation=0.0, formula=f"{sequences} seqs x {seq_len} tokens{how}")
    if budget and run.recompute_forwards == "true" and not recompute:
        notes.append(
            f"--recompute-forwards: the trainer refuses it under {backend} (see recompute_forwards in "
            "docs/configuration.md); the activations are planned without it."
        )
    if backend in ("zero3", "fsdp2"):
        gathered = gathered_working_set(model, compute, backend)
        rule = "min(P, stage3_max_live_parameters=1e9)" if backend == "zero3" else "2 layers + embedding"
        add("gathered parameters (sharded)", gathered, generation=0.0, formula=rule)
    if backend == "zero3" and not run.zero3_init:
        # zero3_init_flag off: every rank loads the whole model before DeepSpeed partitions it; the allocator keeps
        # that memory (host: the C heap; GPU: the caching allocator's reserved blocks).
        models = 1 + (1 if run.has_reference and not lora else 0)
        add(
            "full load before partitioning",
            models * total * compute,
            formula=f"{models} model(s) x {_n(total)} x {compute} B (zero3_init_flag off)",
        )

    # Reference and reward models.
    if run.has_reference and not lora:
        # Every reference is prepared as TRL prepares its own (PPO's too): sharded under ZeRO-3/FSDP2.
        replica = False
        ref = frozen_copy(total, compute, backend, gpus, sharded_like_policy=not replica)
        if not replica and backend == "zero3":
            ref += gathered_working_set(model, compute, backend)  # its forward gathers like the policy's
        add("reference", ref, formula=f"{_n(total)} x {compute} B" + (" (replica)" if replica else f" / {shard_all}"))
    if run.reward_model is not None:
        rm = run.reward_model.complete().total_params
        add("reward model", frozen_copy(rm, compute, backend, gpus, True), formula=f"{_n(rm)} x {compute} B")

    # PPO critic.
    if run.algo == "ppo":
        if run.critic_mode == "shared_base":
            critic_params = trainable + model.hidden + 1
            add("critic (shared base)", critic_params * 16, formula="adapter + value head, fp32 + fp32 AdamW")
        elif critic_sharded(backend):
            # A DeepSpeed engine built from the policy's config, or fully_shard with its FSDP2 options: same
            # precision, same sharding.
            critic_trainable = model.lora_params(run.lora_rank or 16, run.lora_targets) if run.critic_lora else total
            critic_state = training_state(critic_trainable, run.precision, backend, layout.offload, gpus)
            base = total * compute / shard_all if run.critic_lora else 0.0
            gpu = base + sum(v[0] for v in critic_state.values())
            host = sum(v[1] for v in critic_state.values())
            add(
                "critic (separate, sharded)",
                gpu,
                generation=gpu - critic_state["gradients"][0],
                host=host,
                formula=f"{_n(critic_trainable)} trainable, {run.precision}, sharded like the policy",
            )
        else:
            critic_trainable = model.lora_params(run.lora_rank or 16, run.lora_targets) if run.critic_lora else total
            critic_weights = total * 4 + (critic_trainable * 4 if run.critic_lora else 0)
            critic_other = critic_trainable * (4 + 8)
            add(
                "critic (separate)",
                critic_weights + critic_other,
                generation=critic_weights + critic_trainable * 8,
                formula=f"fp32 replica: {_n(total)} x 4 B + {_n(critic_trainable)} trainable x 12 B",
            )

    # Colocated engine.
    if run.uses_engine:
        add_engine(run, model, gpu_memory_gib, add, notes, blockers)

    add("runtime (CUDA context, NCCL, fragmentation)", run.runtime_overhead_gib * GIB, formula="flat margin")
    return Plan(layout, roles, gpu_memory_gib, notes, blockers)


def add_engine(
    run: RunSpec, model: ModelShape, gpu_memory_gib: float, add, notes: list[str], blockers: list[str]
) -> None:
    tp = run.vllm_tensor_parallel_size
    weights = model.total_params * run.vllm_dtype_bytes / tp
    kv_per_token = model.kv_bytes_per_token(run.vllm_dtype_bytes) / tp
    sequences = (run.generation_batch or run.micro_batch) * (run.num_generations if run.algo == "online-dpo" else 1)
    kv_needed = sequences * (run.prompt_length + run.completion_length) * kv_per_token
    if run.vllm_kv_cache_gib is not None:
        awake = weights + run.vllm_kv_cache_gib * GIB + run.vllm_runtime_gib * GIB
        kv_budget = run.vllm_kv_cache_gib * GIB
        formula = f"weights {weights / GIB:.2f} GiB + KV {run.vllm_kv_cache_gib:g} GiB + runtime"
    else:
        awake = run.vllm_gpu_memory_utilization * gpu_memory_gib * GIB
        kv_budget = awake - weights
        formula = f"gpu_memory_utilization {run.vllm_gpu_memory_utilization:g} x {gpu_memory_gib:g} GiB"
        if kv_budget <= 0:
            blockers.append(
                f"vLLM's share ({awake / GIB:.1f} GiB) cannot hold its weights ({weights / GIB:.1f} GiB): raise "
                "--vllm-gpu-memory-utilization or --vllm-tp."
            )
    if kv_budget > 0 and kv_needed > kv_budget:
        fit = int(kv_budget // max(kv_per_token * (run.prompt_length + run.completion_length), 1))
        notes.append(
            f"vLLM's KV cache holds {fit} of the {sequences} sequences at once; the rest wait (slower rollouts)."
        )
    if run.vllm_sleep:
        level = run.sleep_level
        asleep_host = weights if level == 1 else 0.0
        add(
            f"vLLM engine (sleep level {level})",
            0.0,
            generation=awake,
            host=asleep_host,
            formula=formula + f"; asleep: frees it all (level {level}" + (", weights to host)" if level == 1 else ")"),
        )
    else:
        add("vLLM engine (no sleep)", awake, generation=awake, formula=formula + "; stays during training")
