"""The shape of a transformer, as the memory planner needs it: parameters, layers, widths, heads, vocabulary, experts.

Built three ways: from explicit numbers (``ModelShape(params=70e9, layers=80, hidden=8192, heads=64)``), from a
transformers config (``ModelShape.from_config``), or from a local path / Hub id (``ModelShape.from_pretrained``). From a
config the parameter counts are exact: the model is built on the ``meta`` device with ``accelerate.init_empty_weights``
(no memory allocated) and its tensors are counted, embeddings, norms, biases and tied weights included.

Parameter counts of the parts (Llama-style decoder; h = hidden, f = intermediate, d = head_dim, a = heads,
k = KV heads, V = vocabulary, E = experts):

    attention per layer   h*a*d (q) + 2*h*k*d (k, v) + a*d*h (o)          [Vaswani et al. 2017; GQA: Ainslie et al. 2023]
    MLP per layer         3*h*f (gate, up, down; SwiGLU, Shazeer 2020), times E for a mixture of experts
    embeddings            V*h, plus V*h again for an untied LM head
    norms                 2*h per layer + h (final), negligible and kept for exactness against a hand count
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

# Linear layers of a Llama-style decoder layer, by the names PEFT's `target_modules` uses.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTENTION_MODULES + MLP_MODULES


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's size. Unset widths are derived from the others (see ``complete()``)."""

    params: float | None = None
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int | None = None
    vocab: int = 32000
    intermediate: int | None = None
    head_dim: int | None = None
    experts: int = 1
    experts_per_token: int = 1
    tied_embeddings: bool = False
    name: str = "model"

    # ------------------------------------------------------------------ derived sizes
    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def attention_params_per_layer(self) -> int:
        return self.hidden * self.heads * self.dim * 2 + self.hidden * self.kv * self.dim * 2

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def mlp_params_per_layer(self, active_only: bool = False) -> int:
        experts = self.experts_per_token if active_only else self.experts
        router = self.hidden * self.experts if self.experts > 1 else 0
        return 3 * self.hidden * (self.intermediate or 0) * experts + router

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, MLP incl. all experts, two norms)."""
        return self.attention_params_per_layer + self.mlp_params_per_layer() + 2 * self.hidden

    @property
    def total_params(self) -> int:
        """All parameters: the explicit count when given, else the sum of the parts."""
        if self.params is not None:
            return int(self.params)
        return self.layers * self.layer_params + self.embedding_params + self.hidden

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (MoE: only its routed experts); equals total_params for dense models."""
        inactive = self.layers * (self.mlp_params_per_layer() - self.mlp_params_per_layer(active_only=True))
        return self.total_params - inactive

    @property
    def largest_param(self) -> int:
        """The largest single tensor (usually the embedding matrix): ZeRO-3 and FSDP2 gather it whole."""
        return max(self.vocab * self.hidden, self.hidden * (self.intermediate or self.hidden))

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """KV cache per token: 2 (K and V) x layers x KV heads x head_dim x bytes (Pope et al. 2022)."""
        return 2 * self.layers * self.kv * self.dim * dtype_bytes

    def lora_params(self, rank: int, targets: tuple[str, ...] = ALL_LINEAR) -> int:
        """Adapter parameters: r x (d_in + d_out) per targeted linear layer (Hu et al. 2021), experts included."""
        h, f, d = self.hidden, self.intermediate or 0, self.dim
        sizes = {
            "q_proj": (h, self.heads * d),
            "k_proj": (h, self.kv * d),
            "v_proj": (h, self.kv * d),
            "o_proj": (self.heads * d, h),
            "gate_proj": (h, f),
            "up_proj": (h, f),
            "down_proj": (f, h),
        }
        unknown = [t for t in targets if t not in sizes]
        if unknown:
            raise ValueError(f"--lora-targets: unknown module(s) {unknown}; known: {', '.join(ALL_LINEAR)}.")
        per_layer = 0
        for target in targets:
            d_in, d_out = sizes[target]
            copies = self.experts if target in MLP_MODULES else 1
            per_layer += rank * (d_in + d_out) * copies
        return self.layers * per_layer

    # ------------------------------------------------------------------ construction
    def complete(self) -> ModelShape:
        """Fill `intermediate` from `params` when only the total is known (else Llama's ~8/3 h, rounded to 256)."""
        for name in ("layers", "hidden", "heads", "vocab", "experts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}: must be a positive integer, got {getattr(self, name)}.")
        if self.heads % self.kv != 0:
            raise ValueError(f"--kv-heads ({self.kv}) must divide --heads ({self.heads}) (grouped-query attention).")
        if self.intermediate is not None:
            return self
        if self.params is None:
            return replace(self, intermediate=_round_up(int(8 * self.hidden / 3), 256))
        rest = self.params - self.embedding_params - self.layers * (self.attention_params_per_layer + 2 * self.hidden)
        per_layer_mlp = rest / self.layers
        intermediate = int(per_layer_mlp / (3 * self.hidden * self.experts))
        if intermediate <= 0:
            raise ValueError(
                f"--params ({self.params:.3g}) is smaller than the embeddings and attention implied by --layers "
                f"{self.layers}, --hidden {self.hidden}, --vocab {self.vocab}: check the numbers, or give "
                "--intermediate explicitly."
            )
        return replace(self, intermediate=intermediate)

    @classmethod
    def from_config(cls, config, name: str | None = None, params: int | None = None) -> ModelShape:
        """Exact shape of a transformers config: counts the tensors of the model built on the meta device.

        `params` skips the build when the caller has counted a live model (a trainer under ZeRO-3 must not build
        another model: transformers would partition it with collectives).
        """
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if params is None:
            from accelerate import init_empty_weights
            from transformers import AutoModelForCausalLM

            with init_empty_weights():
                model = AutoModelForCausalLM.from_config(config)
            params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        heads = text.num_attention_heads
        experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or 1
        return cls(
            params=params,
            layers=text.num_hidden_layers,
            hidden=text.hidden_size,
            heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            vocab=text.vocab_size,
            intermediate=getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", None),
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            experts=experts,
            experts_per_token=getattr(text, "num_experts_per_tok", None) or 1,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            name=name or getattr(config, "_name_or_path", "") or getattr(config, "model_type", "model"),
        )

    @classmethod
    def from_pretrained(cls, path_or_id: str, trust_remote_code: bool = False) -> ModelShape:
        """Shape of a local model directory or Hub id (only its config.json is read)."""
        from transformers import AutoConfig

        if os.path.isdir(path_or_id) and not os.path.isfile(os.path.join(path_or_id, "config.json")):
            raise ValueError(
                f"--model {path_or_id!r}: the directory has no config.json. Point --model at a model directory "
                "(the one holding config.json), or give the shape with --params/--layers/--hidden/--heads."
            )
        try:
            config = AutoConfig.from_pretrained(path_or_id, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"--model {path_or_id!r}: no model config could be read ({str(error).splitlines()[0]}). Give a local "
                "model directory, a Hub id reachable from here, or the shape with --params/--layers/--hidden/--heads."
            ) from error
        return cls.from_config(config, name=path_or_id)


def _round_up(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)
