"""The PPO critic (value model): a transformer backbone and a scalar value head, in two memory layouts.

- ``SeparateCritic``: its own model (full, or LoRA on its own frozen copy); costs one more backbone in memory.
- ``SharedBaseCritic``: a second LoRA adapter ("critic") on the policy's PEFT model plus a value head, so actor,
  critic and reference (the base with adapters disabled) share one frozen base.

Both return one value per position: ``values(input_ids, attention_mask)[:, t]`` is the value of the state after
token t, i.e. before the token at t + 1 is sampled.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

CRITIC_ADAPTER = "critic"


class ValueHead(nn.Module):
    """hidden state -> scalar, in fp32 (values and returns are compared at full precision)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.summary.weight)  # V = 0 at start: the first advantages are the rewards themselves
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden_states.float()).squeeze(-1)


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

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = _backbone(self.model)(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def named_trainable_parameters(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.named_parameters() if p.requires_grad}


class SharedBaseCritic(nn.Module):
    """The policy's PEFT model with a second adapter, "critic", active while values are computed.

    PEFT's ``set_adapter`` marks only the active adapter trainable; both adapters are kept trainable here (each is
    stepped by its own optimizer), and only the forward changes which one is applied.
    """

    def __init__(self, peft_model: nn.Module, lora_config):
        super().__init__()
        if CRITIC_ADAPTER in peft_model.peft_config:
            raise ValueError(f"The policy already has an adapter named {CRITIC_ADAPTER!r}; rename it.")
        self.policy_adapter = peft_model.active_adapter
        peft_model.add_adapter(CRITIC_ADAPTER, copy.deepcopy(lora_config))
        peft_model.set_requires_grad(CRITIC_ADAPTER, True)
        self._peft_model = [peft_model]  # not a submodule: the policy's weights are not the critic's to save/move
        self.head = ValueHead(_hidden_size(peft_model))

    @property
    def peft_model(self) -> nn.Module:
        return self._peft_model[0]

    @contextmanager
    def _critic_active(self) -> Iterator[None]:
        model = self.peft_model
        model.set_adapter(CRITIC_ADAPTER)
        try:
            yield
        finally:
            model.set_adapter(self.policy_adapter)
            model.set_requires_grad(CRITIC_ADAPTER, True)

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with self._critic_active():
            hidden = _backbone(self.peft_model)(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden)

    def adapter_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.peft_model.named_parameters() if f".{CRITIC_ADAPTER}." in n]

    def trainable_parameters(self) -> list[nn.Parameter]:
        return self.adapter_parameters() + list(self.head.parameters())

    def named_trainable_parameters(self) -> dict[str, nn.Parameter]:
        adapter = {f"adapter.{n}": p for n, p in self.peft_model.named_parameters() if f".{CRITIC_ADAPTER}." in n}
        return {**adapter, **{f"head.{n}": p for n, p in self.head.named_parameters()}}


def critic_state(critic: SeparateCritic | SharedBaseCritic) -> dict[str, torch.Tensor]:
    """The critic's trained tensors (value head included), by name: what a checkpoint must hold to resume it."""
    return {name: p.detach().cpu().clone() for name, p in critic.named_trainable_parameters().items()}


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
    for name, param in params.items():
        param.copy_(state[name])
