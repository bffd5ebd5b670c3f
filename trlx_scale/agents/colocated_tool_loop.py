"""``ColocatedToolLoop``: GRPO's tool-calling turns without lockstep on the colocated engine.

TRL 1.16 keeps the multi-turn rollout in ``_tool_call_loop`` (called by ``_generate`` after the first turn, when the
trainer has tools or an ``environment_factory``): lockstep rounds over the whole batch (see
``agents.tool_call_continuation``). GRPOTrainer's override of that one method runs this component: with
``tool_scheduling='concurrent'`` and trlx_scale's colocated engine, every trajectory continues at its own pace
(``continue_trajectories``, the loop the asynchronous trainer's servers run too, under the same rules:
``agents.trajectory_rules``), its turns added to the running engine (``agents.colocated_turn_sampler``) inside one engine round (``serving_turns``: the weights
served are the trainer's current version, the engine sleeps afterwards). It returns what TRL's loop returns, so
TRL's ``_generate`` and everything after it (rewards with the whole conversation, ``tool_mask`` in the loss and its
normaliser, the metrics) run unchanged.

Where the concurrent loop does not apply (``tool_scheduling='lockstep'``, TRL's transformers or server generation,
tensor-parallel engines whose ranks must sample together, image inputs), TRL's loop runs, and the reason is logged
once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from transformers.utils import logging

from ..compat import trl_trainer_state as trl_state
from ..trainer_part import TrainerPart
from .colocated_turn_sampler import ColocatedTurnSampler
from .tool_call_continuation import STOP_REASONS, TrajectoryState, continue_trajectories
from .tool_runner import ToolStats
from .trajectory_rules import tool_trajectory_rules

logger = logging.get_logger(__name__)

# The most threads the synchronous tools of one rollout hold at once (one per trajectory up to this).
MAX_TOOL_THREADS = 64


class ColocatedToolLoop(TrainerPart):
    """``GRPOTrainer``'s tool loop (``tool_loop``; see the module docstring): its ``_tool_call_loop`` override runs
    ``run``. Needs the trainer's ``_rollout_engine``."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        self._told_lockstep = False

    def run(
        self, trl_loop: Callable, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
    ):
        """TRL's ``_tool_call_loop`` contract; ``trl_loop`` is TRL's own (lockstep) loop."""
        reason = self._lockstep_reason(images, multimodal_fields)
        if reason is not None:
            if self.trainer.args.tool_scheduling == "concurrent" and not self._told_lockstep:
                logger.info("Tool calls run in TRL's lockstep loop: %s.", reason)
                self._told_lockstep = True
            engine = self.trainer._rollout_engine()
            with engine.continuing_turns() if engine is not None else contextlib.nullcontext():
                return trl_loop(prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields)
        engine = self.trainer._rollout_engine()
        states = [
            TrajectoryState(
                prompt=prompts[i],
                prompt_ids=list(prompt_ids[i]),
                completion_ids=list(completion_ids[i]),
                completion=completions[i],
                logprobs=None if logprobs is None else list(logprobs[i]),
                tool_mask=[1] * len(completion_ids[i]),
                tools=tools,
                last_turn_cut=bool(completion_ids[i]) and completion_ids[i][-1] not in self.trainer.eos_token_ids,
            )
            for i, tools in enumerate(self._tools_of_rollouts(len(prompt_ids)))
        ]
        stats = ToolStats()
        executor = ThreadPoolExecutor(
            max_workers=min(MAX_TOOL_THREADS, max(1, len(states))), thread_name_prefix="trlx-scale-tool"
        )
        mode = "train" if self.trainer.model.training else "eval"
        try:
            with engine.serving_turns() as llm:
                sampler = ColocatedTurnSampler(
                    llm, lora_request=engine.llm.lora_request, sampling_params=engine.turn_sampling_params
                )
                rules = tool_trajectory_rules(
                    self.trainer,
                    tokenizer=trl_state.tokenizer(self.trainer),
                    max_model_len=llm.llm_engine.model_config.max_model_len,
                    suffix_ids=self.trainer._get_tool_suffix_ids,
                )
                runners = [
                    rules.runner(trl_state.rollout_tools(self.trainer, i), executor) for i in range(len(states))
                ]
                states = _run_blocking(
                    continue_trajectories(
                        states,
                        runners,
                        [self.trajectory_seed(i, mode) for i in range(len(states))],
                        sampler=sampler,
                        rules=rules,
                        stats=stats,
                    )
                )
        finally:
            executor.shutdown(wait=False, cancel_futures=True)  # a timed-out synchronous tool's thread runs on
        self.record(stats, states, sampler.max_in_flight, engine.pop_metrics(), mode)
        return (
            [state.tool_mask for state in states],
            [state.completion for state in states],
            [state.completion_ids for state in states],
            None if logprobs is None else [state.logprobs for state in states],
            sum(state.tool_calls for state in states),
            sum(state.tool_failures for state in states),
            [[] for _ in states],  # text-only results (image content is refused by the concurrent loop)
        )

    def _lockstep_reason(self, images, multimodal_fields) -> str | None:
        """Why this rollout's tool turns run in TRL's loop, or None for the concurrent one."""
        if self.trainer.args.tool_scheduling == "lockstep":
            return "tool_scheduling='lockstep'"
        engine = self.trainer._rollout_engine()
        if engine is None:
            return "the concurrent loop needs trlx_scale's colocated vLLM engine (use_vllm=True, vllm_mode='colocate')"
        if engine.tensor_parallel_size > 1:
            return "a tensor-parallel engine's ranks sample every request together"
        if images is not None or multimodal_fields or trl_state.is_vlm(self.trainer):
            return "image inputs"
        return None

    def _tools_of_rollouts(self, count: int) -> list:
        """The tools each rollout's prompt was rendered with (what ``parse_response`` needs), as TRL picks them."""
        if self.trainer.environment_factories is not None:
            return [
                trl_state.environment_tool_schemas(self.trainer, name)
                for name in trl_state.batch_environments(self.trainer)
            ]
        return [self.trainer.tools] * count

    def trajectory_seed(self, index: int, mode: str) -> int:
        """A trajectory's seed, from the run's seed, the rank, the step and its index: a resumed run samples the
        later turns the uninterrupted one sampled."""
        key = f"{self.trainer.args.seed}|{self.trainer.accelerator.process_index}|{self.trainer.state.global_step}|{mode}|{index}"
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1

    def record(self, stats: ToolStats, states, max_in_flight: int | None, engine_metrics: dict, mode: str) -> None:
        """The ``tools/*`` and ``agents/*`` metrics of a rollout's trajectories (``states``: anything with their
        ``tool_rounds``, ``truncated_tool_responses``, ``prefix_mismatches`` and ``stop_reason``); ``max_in_flight``
        None: not measured."""
        metrics = trl_state.metrics(self.trainer, mode)
        for name, value in stats.as_metrics().items():
            if name != "tools/failure_frequency":  # TRL logs its own, from the counts this loop returns
                metrics[name].append(value)
        rounds = [state.tool_rounds for state in states]
        metrics["agents/tool_rounds_mean"].append(sum(rounds) / max(len(rounds), 1))
        metrics["agents/tool_rounds_max"].append(float(max(rounds, default=0)))
        if max_in_flight is not None:
            metrics["agents/later_turns_max_in_flight"].append(float(max_in_flight))
        metrics["agents/truncated_tool_responses"].append(float(sum(s.truncated_tool_responses for s in states)))
        metrics["agents/prefix_mismatches"].append(float(sum(s.prefix_mismatches for s in states)))
        for reason in STOP_REASONS:
            share = sum(state.stop_reason == reason for state in states) / max(len(states), 1)
            metrics[f"agents/stopped_{reason}_frac"].append(share)
        for name, value in engine_metrics.items():
            metrics[name].append(value)


def _run_blocking(coroutine) -> Any:
    """Runs ``coroutine`` to completion from synchronous code: on a new event loop in this thread, or, when this
    thread already runs a loop (a notebook), on one in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = asyncio.run(coroutine)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = error

    thread = threading.Thread(target=run, name="trlx-scale-tool-loop")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
