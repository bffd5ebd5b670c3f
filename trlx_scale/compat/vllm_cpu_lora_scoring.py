"""vLLM 0.32's CPU build cannot score prompts (``prompt_logprobs``) in an engine started with ``enable_lora``.

Its CPU LoRA logits path (``punica_cpu.bgmv_shrink``) fails with an einsum size mismatch on every
``prompt_logprobs`` request, also for requests without an adapter. An engine that scores prompts (DPO's reference
log-probs) therefore gets merged full weights instead of a served adapter; nothing is lost, since the reference of a
fresh adapter is its base.

The asynchronous trainer's weight probe (``generation.server_generation``) scores a prompt on a vLLM server that
may have LoRA enabled: there it runs alone (no sampling request beside it), which the CPU path handles; batched with
sampling requests it crashed the server's engine.

Guard: vLLM 0.32.x on a CPU-only machine. tests/test_compat.py fails when a vLLM there scores prompts with LoRA
enabled (then this workaround can go) or when another vLLM is installed (then the guard must be reviewed).
"""

from __future__ import annotations

from .known_warnings import installed_vllm_version

AFFECTED_VLLM_SERIES = "0.32."


def lora_breaks_prompt_logprobs(cpu_only: bool) -> bool:
    """``cpu_only``: the engine runs on the vLLM CPU build (``generation.cpu_environment.running_on_cpu_only``)."""
    return cpu_only and (installed_vllm_version() or "").startswith(AFFECTED_VLLM_SERIES)


def scoring_sync_mode(requested: str, cpu_only: bool) -> str:
    """The weight-sync mode of an engine that scores prompts: ``requested``, or "full" where LoRA breaks scoring."""
    return "full" if lora_breaks_prompt_logprobs(cpu_only) else requested
