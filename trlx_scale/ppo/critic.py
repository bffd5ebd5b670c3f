"""The PPO critic (value model): a transformer backbone and a scalar value head, in two memory layouts.

- ``SeparateCritic``: its own model (full, or LoRA on its own frozen copy); costs one more backbone in memory.
- ``SharedBaseCritic``: a second LoRA adapter ("critic") on the policy's PEFT model plus a value head, so actor,
  critic and reference (the base with adapters disabled) share one frozen base.

Both return one value per position: ``values(input_ids, attention_mask)[:, t]`` (or of packed rows:
``values(input_ids, None, position_ids)``) is the value of the state after
token t, i.e. before the token at t + 1 is sampled.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..generation.weight_sync import unsharded

CRITIC_ADAPTER = "critic"
# The shared-base critic's value head, registered on the policy's PEFT model (so it is sharded and reduced with it).
# The policy's weight sync leaves it out: vLLM has no such weight.
VALUE_HEAD_MODULE = "trlx_value_head"


class ValueHead(nn.Module):
    """hidden state -> scalar, in fp32 (values and returns are compared at full precision)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.summary.weight)  # V = 0 at start: the first advantages are the rewards themselves
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Under DeepSpeed with bf16 on, the head is cast to bf16 with the rest of the critic
        # (critic_training._deepspeed_engine): follow its dtype, and hand out fp32 values either way.
        return self.summary(hidden_states.to(self.summary.weight.dtype)).float().squeeze(-1)


def _backbone(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (``model.model`` for Llama/Qwen), reached through a PEFT wrapper if any."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.base_model


def _hidden_size(model: nn.Module) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.hidden_size)


class SeparateCritic(nn.Module):
    """A value model of its own: ``model`` is a causal LM (optionally PEFT-wrapped) whose backbone feeds the head."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.head = ValueHead(_hidden_size(model))
        # The value head reads the backbone's hidden states: an untied LM head is never used. Frozen, it gets no
        # gradient or Adam state, and DDP (which requires every trainable parameter to take part) accepts it.
        output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if output is not None and output.weight is not embedding.weight:
            output.weight.requires_grad_(False)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        # The forward is the values, so that a DDP wrapper or a DeepSpeed engine around the critic runs it.
        # Packed rows (passes.packed_rows) come with position_ids and no attention mask.
        hidden = _backbone(self.model)(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.head(hidden)

    def values(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self(input_ids, attention_mask, position_ids)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def named_trainable_parameters(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.named_parameters() if p.requires_grad}


class SharedBaseCritic(nn.Module):
    """The policy's PEFT model with a second adapter, "critic", active while values are computed.

    The critic adapter and the value head are parameters of the policy's module (the head is registered on it as
    ``VALUE_HEAD_MODULE``): whatever wraps the policy (DDP, a DeepSpeed ZeRO-3 engine) shards and reduces them with
    it, and they are trained by the policy's optimizer in a parameter group of their own (the trainer's
    ``create_optimizer``). PEFT's ``set_adapter`` marks only the active adapter trainable; both adapters are kept
    trainable here, and only the forward changes which one is applied.
    """

    def __init__(self, peft_model: nn.Module, lora_config):
        super().__init__()
        if CRITIC_ADAPTER in peft_model.peft_config:
            raise ValueError(f"The policy already has an adapter named {CRITIC_ADAPTER!r}; rename it.")
        self.policy_adapter = peft_model.active_adapter
        peft_model.add_adapter(CRITIC_ADAPTER, copy.deepcopy(lora_config))
        peft_model.set_requires_grad(CRITIC_ADAPTER, True)
        self._peft_model = [peft_model]  # not a submodule: the policy's weights are not the critic's to save/move
        device = next(peft_model.parameters()).device
        peft_model.add_module(VALUE_HEAD_MODULE, ValueHead(_hidden_size(peft_model)).to(device))

    @property
    def peft_model(self) -> nn.Module:
        return self._peft_model[0]

    @property
    def head(self) -> ValueHead:
        return getattr(self.peft_model, VALUE_HEAD_MODULE)

    @contextmanager
    def _critic_active(self) -> Iterator[None]:
        model = self.peft_model
        model.set_adapter(CRITIC_ADAPTER)
        try:
            yield
        finally:
            model.set_adapter(self.policy_adapter)
            model.set_requires_grad(CRITIC_ADAPTER, True)

    @contextmanager
    def _without_recomputation(self) -> Iterator[None]:
        """The critic's forward is never gradient-checkpointed. Checkpointed layers recompute their forward during
        the backward, when the policy's adapter is the active one again: the critic adapter's gradients would be
        computed through the policy's adapter (measured: wrong by O(10) on the embedded model), and under ZeRO-3 the
        policy adapter's gradients would be reduced twice (DeepSpeed's duplicate ``ds_id`` assertion). Switched off
        the way transformers switches it (each ``GradientCheckpointingLayer``'s documented flag), for this forward
        only; tests/test_ppo.py checks the gradients against a run without checkpointing. The price: the critic's
        activations are kept, not recomputed."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [
            m
            for m in self.peft_model.modules()
            if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
        ]
        for layer in layers:
            layer.gradient_checkpointing = False
        try:
            yield
        finally:
            for layer in layers:
                layer.gradient_checkpointing = True

    def values(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        with self._critic_active(), self._without_recomputation():
            hidden = _backbone(self.peft_model)(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state
        return self.head(hidden)

    def adapter_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.peft_model.named_parameters() if f".{CRITIC_ADAPTER}." in n]

    def trainable_parameters(self) -> list[nn.Parameter]:
        return self.adapter_parameters() + list(self.head.parameters())

    def named_trainable_parameters(self) -> dict[str, nn.Parameter]:
        adapter = {f"adapter.{n}": p for n, p in self.peft_model.named_parameters() if f".{CRITIC_ADAPTER}." in n}
        return {**adapter, **{f"head.{n}": p for n, p in self.head.named_parameters()}}


@contextmanager
def _gathered(params: list[nn.Parameter], modifier_rank: int | None = None) -> Iterator[None]:
    """DeepSpeed ZeRO-3 partitions gathered into full tensors for the block (``modifier_rank``: whose writes are
    kept and re-partitioned); a no-op for ordinary tensors."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
            yield
    else:
        yield


def critic_state(critic: SeparateCritic | SharedBaseCritic) -> dict[str, torch.Tensor]:
    """The critic's trained tensors (value head included), by name: what a checkpoint must hold to resume it.
    Under ZeRO-3 and FSDP2 this gathers, so every rank must call it."""
    params = critic.named_trainable_parameters()
    with _gathered(list(params.values())):
        return {name: unsharded(p).detach().cpu().clone() for name, p in params.items()}


@torch.no_grad()
def load_critic_state(critic: SeparateCritic | SharedBaseCritic, state: dict[str, torch.Tensor]) -> None:
    """Copy ``critic_state``'s tensors back in place (the critic optimizer keeps pointing at the same tensors)."""
    params = critic.named_trainable_parameters()
    if set(params) != set(state):
        missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise ValueError(
            f"The checkpoint's critic does not match this critic (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}): resume with the critic_mode and critic_use_peft it was saved with."
        )
    with _gathered(list(params.values()), modifier_rank=0):
        for name, param in params.items():
            param.copy_(_like(state[name], param))


def _like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``param``: for an FSDP2 DTensor, this rank's shard of it. Every rank read the same
    checkpoint, so each cuts its own shard (``src_data_rank=None``: no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full
