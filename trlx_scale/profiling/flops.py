"""Model FLOPs of the passes a trainer runs, counted from the model's own layers.

Per token, a matmul with an ``m x n`` weight costs ``2mn`` FLOPs forward (a multiply and an add per weight). So:

- forward: ``2 * N`` per token, N = parameters of every linear layer that runs (the LM head included, input
  embeddings excluded: a lookup is no matmul), plus attention: the query at position ``t`` meets ``t`` keys (causal),
  ``2 * d_attn * t`` FLOPs for the scores and as many for the weighted sum, per layer (``d_attn`` = heads x head_dim);
- backward: ``2 * N`` for the activation gradients plus ``2 * N_trainable`` for the weight gradients, attention twice
  its forward. Full fine-tuning gives the familiar ``6 * N`` per token; LoRA runs ``4 * N_base + 6 * N_lora``: the
  frozen base still back-propagates activations but computes no weight gradient;
- generation: the prompt's forward once per unique prompt (vLLM's prefix cache and ``n=G``), then one forward per
  generated token, each attending over the prompt and the tokens before it.

These are model FLOPs (the work the model defines, what MFU divides by the peak): padding, recomputation under
gradient checkpointing and the optimizer are not counted. MoE layers count every expert (an overestimate for
sparse models). The first layer's input gradient, which a frozen embedding does not need, is counted (negligible).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelFlops:
    """What the FLOPs formulas need of a model: matmul parameters (base and LoRA), layers, attention width."""

    base_matmul_params: int
    lora_matmul_params: int
    base_trainable: bool
    num_layers: int
    attention_width: int  # query heads x head_dim

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelFlops:
        """Count ``model``'s linear layers (``nn.Linear`` and GPT-2's ``Conv1D``); LoRA's ``lora_A``/``lora_B``
        apart. Under ZeRO-3 a parameter's full size is its ``ds_numel``."""
        base = lora = 0
        base_trainable = False
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or not _is_matmul(module):
                continue
            size = getattr(weight, "ds_numel", weight.numel())
            if ".lora_" in f".{name}":
                lora += size
            else:
                base += size
                base_trainable = base_trainable or weight.requires_grad
        config = getattr(model, "config", None)
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0)
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 0)
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
        head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else 0)
        return cls(base, lora, base_trainable, int(layers), int(heads * head_dim))

    # ---------------------------------------------------------------- per pass
    def attention_flops(self, start: int, end: int) -> float:
        """Forward attention FLOPs of the tokens at positions ``start+1 .. end`` (1-based), each attending causally
        to every position up to its own: ``4 * d_attn * layers * sum(t)``."""
        positions = (end * (end + 1) - start * (start + 1)) / 2
        return 4.0 * self.attention_width * self.num_layers * positions

    def forward_flops(self, lengths: Sequence[int]) -> float:
        """One forward pass over sequences of these (unpadded) lengths."""
        tokens = float(sum(lengths))
        linear = 2.0 * (self.base_matmul_params + self.lora_matmul_params) * tokens
        return linear + sum(self.attention_flops(0, n) for n in lengths)

    def training_flops(self, lengths: Sequence[int]) -> float:
        """Forward and backward over sequences of these lengths (see the module docstring for LoRA)."""
        tokens = float(sum(lengths))
        base_factor = 6.0 if self.base_trainable else 4.0
        linear = (base_factor * self.base_matmul_params + 6.0 * self.lora_matmul_params) * tokens
        return linear + 3.0 * sum(self.attention_flops(0, n) for n in lengths)


def _is_matmul(module: torch.nn.Module) -> bool:
    if isinstance(module, torch.nn.Linear):
        return True
    return type(module).__name__ == "Conv1D"  # GPT-2 style (transformers.pytorch_utils.Conv1D)


def generation_flops(
    shape: ModelFlops, unique_prompt_lengths: Sequence[int], rows: Sequence[tuple[int, int]]
) -> float:
    """FLOPs of a generation call: every unique prompt prefilled once, then each row's ``(prompt_length,
    completion_length)`` decoded token by token over its growing context."""
    prefill = shape.forward_flops(unique_prompt_lengths)
    linear = 2.0 * (shape.base_matmul_params + shape.lora_matmul_params)
    decode = sum(
        linear * completion + shape.attention_flops(prompt, prompt + completion) for prompt, completion in rows
    )
    return prefill + decode
