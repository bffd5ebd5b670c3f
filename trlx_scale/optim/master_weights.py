"""AdamW with fp32 master weights for a model whose parameters are bf16.

Why: bf16 keeps 8 bits of mantissa, so a weight of magnitude 1 only changes when an update exceeds half its spacing
(2**-8 ~ 0.0039). RL steps are ~1e-6: applied to bf16 weights they round away and the policy never moves, while
the loss says it trains. Here the optimizer keeps an fp32 copy of every trainable parameter (the master) and fp32
Adam moments; each step reads the bf16 gradients, updates the masters in fp32, and writes the rounded result back
into the bf16 parameters that forward/backward (and vLLM) use. Small updates accumulate in the master until they
cross a bf16 step.

Single device and DDP use this optimizer. FSDP2 and DeepSpeed ZeRO-3 keep fp32 masters themselves
(see ``trlx_scale.optim.distributed_precision``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

MASTER_KEY = "fp32_master_params"


class FP32MasterAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` over fp32 copies of (usually bf16) model parameters.

    Args:
        params: the model's trainable parameters, or parameter groups (dicts with ``params`` and options), exactly as
            for ``torch.optim.AdamW``.
        **kwargs: AdamW options (``lr``, ``betas``, ``eps``, ``weight_decay``, ...).

    ``param_groups`` hold the masters, so LR schedulers and gradient-norm logging work unchanged; ``state_dict()``
    carries the masters too, so a checkpoint restores them bit for bit.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], **kwargs: Any):
        groups = list(params)
        if not groups:
            raise ValueError("FP32MasterAdamW got no parameters: pass the model's trainable parameters.")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.model_params: list[torch.nn.Parameter] = []
        master_groups = []
        for group in groups:
            masters = []
            for param in group["params"]:
                if not param.requires_grad:
                    raise ValueError("FP32MasterAdamW got a frozen parameter: pass only trainable parameters.")
                self.model_params.append(param)
                masters.append(torch.nn.Parameter(param.detach().to(torch.float32).clone()))
            master_groups.append({**group, "params": masters})
        # Each model parameter appears once: nanochat-style check that the groups partition the parameters.
        if len({id(p) for p in self.model_params}) != len(self.model_params):
            raise ValueError("A parameter appears in more than one parameter group.")
        kwargs.setdefault("foreach", False)  # masters may live on CPU while grads arrive from elsewhere; keep simple
        super().__init__(master_groups, **kwargs)

    def add_trainable_group(self, group: dict[str, Any]) -> None:
        """``add_param_group`` for model parameters: their fp32 masters join the optimizer as a new group (a plain
        ``add_param_group`` would step the model parameters themselves, without masters)."""
        masters = []
        for param in group["params"]:
            if not param.requires_grad:
                raise ValueError("FP32MasterAdamW got a frozen parameter: pass only trainable parameters.")
            if any(param is known for known in self.model_params):
                raise ValueError("A parameter appears in more than one parameter group.")
            masters.append(torch.nn.Parameter(param.detach().to(torch.float32).clone()))
        self.add_param_group({**group, "params": masters})
        self.model_params.extend(group["params"])

    @property
    def master_params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("FP32MasterAdamW does not support closures (the model parameters are not the masters).")
        for model_param, master in zip(self.model_params, self.master_params, strict=True):
            master.grad = None if model_param.grad is None else model_param.grad.to(torch.float32)
        super().step()
        for model_param, master in zip(self.model_params, self.master_params, strict=True):
            model_param.copy_(master)  # round to the model's dtype
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for param in self.model_params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state[MASTER_KEY] = [master.detach().clone() for master in self.master_params]
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop(MASTER_KEY, None)
        if masters is None:
            raise ValueError(
                f"This optimizer state has no '{MASTER_KEY}': it was not saved by FP32MasterAdamW. Resume with the "
                "same fp32_master_weights setting it was saved with."
            )
        if len(masters) != len(self.model_params):
            raise ValueError(f"Saved {len(masters)} master tensors, this optimizer has {len(self.model_params)}.")
        super().load_state_dict(state_dict)
        for model_param, master, saved in zip(self.model_params, self.master_params, masters, strict=True):
            master.copy_(saved)
            model_param.copy_(saved)


def cast_for_master_weights(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
    """Hold every floating-point parameter and buffer of ``model`` in ``dtype`` (bf16 compute, bf16 to vLLM).

    The fp32 values live on in the optimizer's masters; for LoRA the frozen base is simply stored in bf16.
    """
    model.to(dtype)
