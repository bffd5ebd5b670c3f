"""``GroupedLLM``: the vLLM handle TRL's colocate ``generate`` drives.

TRL's ``VLLMGeneration.generate`` (sampling parameters, structured outputs, the tensor-parallel gather and slice,
images, the PEFT barrier) calls ``llm.generate(rows, sampling_params=..., use_tqdm=False)`` with one row per
completion (n=1), and ``llm.wake_up``/``llm.sleep`` around it when sleep mode is on. Handing it this object instead of
the ``vllm.LLM`` keeps all of that TRL's own code, and changes three things:

- each run of identical consecutive prompts (a GRPO group) goes to vLLM once with ``n`` samples, so prefix caching
  computes the prompt once and shares its KV blocks (``group_generation``); rows come back in TRL's order, one
  completion each;
- the LoRA adapter the engine synced is served with every request (LoRA-only weight sync);
- with a seed context set, each request gets its own seed (``rollout_seeds``), so a resumed run samples what the
  uninterrupted one did;
- sleep and wake are the engine's lifecycle's (``lifecycle.EngineLifecycle``: the right tags, order and level), so
  TRL's calls are no-ops here.

Every other attribute is the real engine's (``llm.llm_engine`` etc.).
"""

from __future__ import annotations

from typing import Any

from .group_generation import collapse_runs, expand_outputs
from .rollout_seeds import RolloutSeedContext, request_seed


class CompletionRow:
    """One row of TRL's view: a prompt and one sampled completion (what ``extract_logprobs`` and TRL read)."""

    __slots__ = ("outputs", "prompt_token_ids")

    def __init__(self, prompt_token_ids, sample):
        self.prompt_token_ids = prompt_token_ids
        self.outputs = [sample]


class GroupedLLM:
    def __init__(self, llm):
        self.inner = llm
        # The adapter the engine synced last (None: base or merged weights); set by the engine after each sync.
        # A plain attribute, not a callback into the engine: a reference cycle would delay freeing vLLM, whose
        # teardown then breaks the next engine of the process.
        self.lora_request: Any = None
        self.last_unique_prompts = 0
        # Set by the trainer before each rollout when per-request seeds are on (rollout_seeds.py); None: vLLM's
        # engine-wide generator, as in TRL.
        self.seed_context: RolloutSeedContext | None = None

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def generate(self, prompts: list[dict], sampling_params=None, use_tqdm: bool = False, **kwargs) -> list:
        runs = collapse_runs(
            [row["prompt_token_ids"] for row in prompts], [row.get("multi_modal_data") for row in prompts]
        )
        per_run = []
        # Every data-parallel rank holds as many rows as the others: its rows start at rank x rows globally.
        offset = self.seed_context.rank * len(prompts) if self.seed_context is not None else 0
        for first, count in runs:
            params = sampling_params.clone()
            params.n = count
            if self.seed_context is not None:
                params.seed = request_seed(self.seed_context, prompts[first]["prompt_token_ids"], offset + first)
            per_run.append(params)
        outputs = self.inner.generate(
            [prompts[first] for first, _ in runs],
            sampling_params=per_run,
            lora_request=self.lora_request,
            use_tqdm=use_tqdm,
            **kwargs,
        )
        self.last_unique_prompts = len(runs)
        return expand_outputs(
            runs, [[CompletionRow(output.prompt_token_ids, sample) for sample in output.outputs] for output in outputs]
        )

    def wake_up(self, tags: list[str] | None = None) -> None:
        """No-op: the engine's lifecycle woke the engine (weights, then KV cache) before TRL's generate."""

    def sleep(self, level: int = 1) -> None:
        """No-op: the engine's lifecycle puts the engine to sleep after TRL's generate, at its own level."""
