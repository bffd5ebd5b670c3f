"""``ServerToolLoop``: tools and environments under ``AsyncGRPOTrainer``, sampled by the producer on the servers.

TRL's contracts stay the user's: ``tools=[fn]`` and ``environment_factory`` (``reset(**row)``, public methods become
tools, ``get_reward`` a reward source, a dict routing rows by their ``environment`` column) are what
``GRPOTrainer`` takes. What moves is where the trajectories run: the producer samples each group's trajectories on
the servers ahead of the trainer (``agents.server_tool_sampler``: every trajectory at its own pace, its tools off the
event loop's thread under ``tool_timeout``), each with an environment of its own drawn from the producer's pool and
reset there, off the trainer's thread. Reward functions get the whole conversation and the producer's environments,
as TRL gives them the trainer's.

The trainer's side runs TRL's ``_generate`` as it is: the first turns are what its call for completions returns
(TRL parses them), and its ``_tool_call_loop`` returns the producer's finished trajectories (ids, ``tool_mask``,
log-probs, messages, counts) instead of running tools, so the loss, its normaliser and TRL's metrics see what the
synchronous trainer's loop would hand them. TRL's own environment instances, which go unused, are not reset
(``_resets_trl_environments``): the producer's were reset for each group.

Not here (refused by name): ``rollout_func``, evaluation with tools, observations returned by ``reset`` (the prompt
of a group is sampled once for its ``n`` trajectories, tokenized before any environment is drawn: put the task in
the prompt and return None, as TRL's own examples do).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..agents.colocated_tool_loop import MAX_TOOL_THREADS
from ..agents.server_tool_sampler import (
    FIRST_TURN_IDS,
    FIRST_TURN_LOGPROBS,
    TOOL_MASKS,
    TRAJECTORY_TOOLS,
    ServerToolGroupSampler,
    TrajectoryTools,
    tool_stats,
    trajectory_summaries,
)
from ..agents.tool_runner import ToolStats, bounded_call
from ..agents.trajectory_rules import tool_trajectory_rules
from ..compat import trl_trainer_state as trl_state
from ..compat.trl_generation_call import current_generation_call, served_groups
from ..compat.trl_tool_suffix import tool_suffix_renderer
from ..rollout.async_producer import GroupRequest, SampledGroup
from ..trainer_part import TrainerPart


class ServerToolLoop(TrainerPart):
    """Part of ``AsyncGRPOTrainer`` (see the module docstring); its metrics are the tool loop's (``tool_loop.record``).
    It owns the producer's environment pools and the executor of the synchronous tools."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        self.environment_pools: dict[Any, list[Any]] = {}
        self.environment_lock = threading.Lock()
        self.tool_executor: ThreadPoolExecutor | None = None

    def check(self) -> None:
        """At construction: what this trainer cannot do with tools, refused by name."""
        if not self.trainer.tools:
            return
        if self.trainer.args.eval_strategy != "no":
            raise ValueError(
                "AsyncGRPOTrainer with tools or an environment_factory does not evaluate yet: set eval_strategy='no' "
                "(evaluate with GRPOTrainer on the saved model), or train without tools."
            )
        if self.trainer.args.tool_scheduling == "lockstep":
            raise ValueError(
                "tool_scheduling='lockstep' is GRPOTrainer's (TRL's loop); AsyncGRPOTrainer runs every trajectory at "
                "its own pace on the servers. Leave tool_scheduling at 'concurrent'."
            )

    def group_sampler(self, client: Any) -> ServerToolGroupSampler:
        """The producer's sampler of whole trajectories (``agents.server_tool_sampler``)."""
        tokenizer = self.trainer.producer_tokenizer  # the producer's own copy: tokenizers are not thread-safe
        self.tool_executor = ThreadPoolExecutor(max_workers=MAX_TOOL_THREADS, thread_name_prefix="trlx-scale-tool")
        rules = tool_trajectory_rules(
            self.trainer,
            tokenizer=tokenizer,
            max_model_len=served_context(client),
            suffix_ids=tool_suffix_renderer(self.trainer, tokenizer),
        )
        return ServerToolGroupSampler(
            client,
            tools_for=self.trajectory_tools,
            rules=rules,
            eos_token_ids=self.trainer.eos_token_ids,
            executor=self.tool_executor,
        )

    # ---------------------------------------------------------------- the producer's thread
    async def trajectory_tools(self, request: GroupRequest) -> list[TrajectoryTools]:
        """Each trajectory's tools: the standalone ones, plus the methods of an environment of its own, drawn from the
        producer's pool and reset for the group's row off the event loop's thread (``tool_timeout`` bounds it)."""
        row = request.prompt["row"]
        count = request.num_generations
        if self.trainer.environment_factories is None:
            functions = {tool.__name__: tool for tool in trl_state.standalone_tools(self.trainer)}
            return [TrajectoryTools(functions, self.trainer.tools) for _ in range(count)]
        name = row.get("environment") if trl_state.multi_environment(self.trainer) else None
        if name not in self.trainer.environment_factories:
            raise ValueError(
                f"Example has `environment={name!r}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(self.trainer.environment_factories)}."
            )
        reset_kwargs = (
            {k: v for k, v in row.items() if k != "environment"} if trl_state.multi_environment(self.trainer) else row
        )
        environments = [self.acquire_environment(name) for _ in range(count)]
        owned = [
            TrajectoryTools(
                self.environment_functions(env), trl_state.environment_tool_schemas(self.trainer, name), env, name
            )
            for env in environments
        ]
        try:
            observations = await asyncio.gather(
                *(
                    bounded_call(
                        env.reset,
                        self.tool_executor,
                        self.trainer.args.tool_timeout,
                        **reset_kwargs,
                    )
                    for env in environments
                )
            )
        except BaseException:
            self.release_environments(owned)
            raise
        if any(observation is not None for observation in observations):
            self.release_environments(owned)
            raise ValueError(
                f"{type(environments[0]).__name__}.reset returned an observation: AsyncGRPOTrainer samples a group's "
                "prompt once for its trajectories, before any environment is drawn. Put the task in the dataset's "
                "prompt and return None from reset, or train with GRPOTrainer."
            )
        return owned

    def environment_functions(self, environment: Any) -> dict[str, Any]:
        """TRL's rule: the standalone tools and the environment's public methods but ``reset`` and ``get_reward``."""
        methods = [
            getattr(environment, member)
            for member, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
            if member not in ("reset", "get_reward") and not member.startswith("_")
        ]
        return {tool.__name__: tool for tool in [*trl_state.standalone_tools(self.trainer), *methods]}

    def acquire_environment(self, name: Any) -> Any:
        with self.environment_lock:
            pool = self.environment_pools.setdefault(name, [])
            if pool:
                return pool.pop()
        return self.trainer.environment_factories[
            name
        ]()  # "construct once, reset often": the pool grows to what is in flight

    def release_environments(self, owned: Sequence[TrajectoryTools]) -> None:
        with self.environment_lock:
            for tools in owned:
                if tools.environment is not None:
                    self.environment_pools.setdefault(tools.environment_name, []).append(tools.environment)

    def group_reward_inputs(self, sampled: SampledGroup) -> tuple[list, dict[str, Any]]:
        """What a tool group's reward functions get beside TRL's columns: the conversations after the prompt, and the
        producer's environments when there are any (TRL's ``environments`` argument)."""
        owned = sampled.extras[TRAJECTORY_TOOLS]
        extra = {"environments": [tools.environment for tools in owned]} if self.trainer.environment_factories else {}
        return list(sampled.completions), extra

    def group_scored(self, sampled: SampledGroup) -> None:
        """After scoring: the environments go back to the pool and out of the group (a checkpoint keeps groups)."""
        self.release_environments(sampled.extras.pop(TRAJECTORY_TOOLS, []))

    # ---------------------------------------------------------------- the trainer's thread: TRL's hooks
    def first_turns(
        self, base_generate, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        """TRL's first turn: the producer's first turns (TRL parses them); the rest is in ``_tool_call_loop``."""
        result = base_generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images)
        if not self.trainer.tools or not self.trainer.model.training:
            return result
        call = current_generation_call()
        groups = served_groups(None if call is None else call.groups, "TRL's _generate_single_turn")
        extras = [group.sampled.extras for group in groups]
        return (
            [ids for extra in extras for ids in extra[FIRST_TURN_IDS]],
            [values for extra in extras for values in extra[FIRST_TURN_LOGPROBS]],
        )

    def resets_trl_environments(self) -> bool:
        # Training rollouts are the producer's, with environments of its own reset off the trainer's thread: TRL's
        # instances go unused, so they are not reset (agents.environment_resets).
        return not self.trainer.model.training

    def tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        """The producer's finished trajectories, in TRL's loop's return shape."""
        if not self.trainer.model.training:
            raise RuntimeError("AsyncGRPOTrainer does not evaluate with tools (refused at construction).")
        call = current_generation_call()
        scored = served_groups(None if call is None else call.groups, "TRL's first turn (_generate_single_turn)")
        groups = [group.sampled for group in scored]
        first = [ids for group in groups for ids in group.extras[FIRST_TURN_IDS]]
        if [list(ids) for ids in completion_ids] != first:
            raise RuntimeError("the first turns TRL parsed are not the producer's (the rollout's order changed).")
        stats = ToolStats()
        for group in groups:
            stats.merge(tool_stats(group.extras))
        summaries = [summary for group in groups for summary in trajectory_summaries(group.extras)]
        self.trainer.tool_loop.record(stats, summaries, None, {}, "train")
        # Full weights: a reload between two turns of a trajectory (the later ones sampled by the newer version).
        crossed = [len(set(summary.turn_versions)) > 1 for summary in summaries]
        trl_state.metrics(self.trainer, "train")["async/trajectories_across_versions_frac"].append(
            sum(crossed) / max(len(crossed), 1)
        )
        return (
            [mask for group in groups for mask in group.extras[TOOL_MASKS]],
            [list(messages) for group in groups for messages in group.completions],
            [ids for group in groups for ids in group.completion_ids],
            None if logprobs is None else [values for group in groups for values in group.logprobs],
            sum(summary.tool_calls for summary in summaries),
            sum(summary.tool_failures for summary in summaries),
            [[] for _ in summaries],
        )

    def close(self) -> None:
        if self.tool_executor is not None:
            self.tool_executor.shutdown(wait=False, cancel_futures=True)  # a timed-out tool's thread runs on
            self.tool_executor = None


def served_context(client: Any) -> int:
    """The smallest context among the servers' base models: what a trajectory's tokens must fit."""
    return min(
        entry["max_model_len"]
        for url in client.base_urls
        for entry in client.served_models(url)
        if entry.get("parent") is None
    )
