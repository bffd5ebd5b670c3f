"""A ``TurnSampler`` on a vLLM engine in this process (the colocated engine): each turn is a request added to the
engine as soon as its trajectory asks, and the engine is stepped on the rollout's event loop, so its continuous
batching takes whichever turns are ready.

``LLM.generate`` takes a batch and returns when the whole batch is done: a multi-turn loop on it is lockstep (every
turn waits for the batch's longest generation, then for the batch's slowest tool). Here a driver steps the engine
(``LLMEngine.step``: one forward over every request in flight) while any turn is waiting, and yields to the event
loop between steps: a trajectory whose tool has returned adds its next turn at the next step, while the others are
mid-generation or still waiting on their tools. Stepping on the loop's thread (not a thread of its own) keeps every
engine call on one thread; synchronous tools run in their pool meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from ..generation.rollout_seeds import turn_seed
from .multi_turn_rollout import SampledTurn


class ColocatedTurnSampler:
    """Samples turns on ``llm`` (a ``vllm.LLM`` in this process; see the module docstring)."""

    def __init__(
        self,
        llm: Any,
        temperature: float = 1.0,
        lora_request: Any = None,
        sampling_params: Callable[[int, int], Any] | None = None,
    ):
        self.engine = llm.llm_engine
        self.temperature = temperature
        self.lora_request = lora_request
        # (max_tokens, seed) -> SamplingParams: the trainer's engine passes its own (TRL's sampling fields), so a
        # later turn samples as the first one did; without it, plain sampling at ``temperature``.
        self.sampling_params = sampling_params
        self.max_in_flight = 0  # the most turns the engine batched together (a metric of the overlap)
        self._waiting: dict[str, asyncio.Future] = {}
        self._driver: asyncio.Task | None = None
        self._ids = itertools.count()

    async def sample(self, prompt_ids: list[int], max_tokens: int, seed: int, turn: int) -> SampledTurn:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.sampling_params is not None:
            params = self.sampling_params(max_tokens, turn_seed(seed, turn))
        else:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                seed=turn_seed(seed, turn),
                logprobs=0,
                skip_special_tokens=False,
            )
        request_id = f"trlx-scale-turn-{next(self._ids)}"
        future = asyncio.get_running_loop().create_future()
        self.engine.add_request(
            request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)), params, lora_request=self.lora_request
        )
        self._waiting[request_id] = future
        self.max_in_flight = max(self.max_in_flight, len(self._waiting))
        if self._driver is None or self._driver.done():
            self._driver = asyncio.ensure_future(self._drive())
        try:
            return await future
        except asyncio.CancelledError:  # the trajectory was cancelled: its turn leaves the engine too
            if self._waiting.pop(request_id, None) is not None:
                self.engine.abort_request([request_id])
            raise

    async def _drive(self) -> None:
        try:
            while self._waiting:
                await asyncio.sleep(0)  # trajectories whose environment answered add their turns to this step
                for output in self.engine.step():
                    future = self._waiting.pop(output.request_id, None) if output.finished else None
                    if future is not None and not future.done():
                        future.set_result(_sampled_turn(output.outputs[0]))
        except Exception as error:  # noqa: BLE001 - every waiting turn raises the engine's error, where it awaits
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(error)
            self._waiting.clear()


def _sampled_turn(completion: Any) -> SampledTurn:
    ids = list(completion.token_ids)
    logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs, ids, strict=True)]
    return SampledTurn(
        ids=ids, logprobs=logprobs, finish_reason="length" if completion.finish_reason == "length" else "stop"
    )
