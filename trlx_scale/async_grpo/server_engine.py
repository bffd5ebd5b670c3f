"""``AsyncServerEngineMixin``: ``AsyncGRPOTrainer``'s engine, built at the first rollout, when the resume point is known.

In order: the servers (``AsyncServerLaunchMixin``: a URL given, or one the trainer starts, in the weights format
and dtype it chooses) and their client; the prompt stream that replays TRL's sampler per rank; the staleness schedule
from the rollout about to be trained (a checkpoint's window continued); the reward scorer; the weight transport
(refused before anything starts, so a refusal leaves no thread and no server of the trainer's); the producer, with
the sampler of the run's groups (single-turn, whole tool trajectories, or ``GymRollout`` episodes); and the server
engine TRL's calls go through.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..generation.engine import build_engine
from ..generation.server_client import SamplingSettings, VLLMServerClient
from ..generation.server_generation import ServerGeneration, delivers_in_background
from ..generation.server_weight_transports import build_server_transport
from ..generation.weight_sync import lora_ineligibility
from ..rollout.async_producer import RolloutProducer
from ..rollout.prompt_stream import RankPromptStream
from ..rollout.reward_scoring import ConcurrentRewardScorer
from ..rollout.staleness import StalenessSchedule
from .tool_loop import served_context


class AsyncServerEngineMixin:
    """Part of ``AsyncGRPOTrainer`` (see the module docstring)."""

    def _build_server_engine(self) -> ServerGeneration:
        args = self.args
        sync_mode = self._server_sync_mode()
        if sync_mode == "lora" and lora_ineligibility(self.model):
            sync_mode = "full"
        urls, process = self._start_server(sync_mode)
        client = VLLMServerClient(
            urls,
            model=self._base_model_path(),
            sampling=SamplingSettings(
                max_tokens=self.max_completion_length,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                repetition_penalty=self.repetition_penalty,
            ),
            request_timeout=args.request_timeout,
            lora=sync_mode == "lora",
            process=process,
            prompt_ids=lambda prompt: prompt["prompt_ids"],
            keep_requests_on_reload=args.full_weight_reload == "keep",
        )
        if self.accelerator.is_main_process:
            client.check_model(self._base_model_path())
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        rows = args.per_device_train_batch_size * args.steps_per_generation
        self._prompt_stream = RankPromptStream(
            self._get_train_sampler,
            self.train_dataset,
            rank=rank,
            world_size=world,
            rows_per_rollout=rows,
            num_generations=self.num_generations,
            repeat_count=self.num_iterations * args.steps_per_generation,
        )
        groups = self._prompt_stream.groups_per_rollout
        start = self._current_rollout()  # built at a rollout's start (or an evaluation between two)
        oldest, ready = self.rollout_window.continued_window(groups, start * groups)
        self._schedule = StalenessSchedule(
            groups_per_version=groups,
            max_staleness=args.max_staleness,
            weight_sync_steps=args.weight_sync_steps,
            start_index=start * groups,
            start_version=start,
            oldest_version=oldest,
        )
        self._next_prefetch = start * groups + len(ready)
        inflight = args.max_inflight_tasks if args.max_inflight_tasks > 0 else groups * (args.max_staleness + 1)
        self._reward_scorer = ConcurrentRewardScorer(self._async_reward_funcs, max_workers=args.async_reward_workers)
        self._producer_tokenizer = copy.deepcopy(self.processing_class)  # decoding off the trainer's thread
        # Full weights in the dtype of a server this trainer started; one the user started casts on load.
        weights_dtype = getattr(torch, self._server_dtype()) if process is not None else None
        try:  # before the producer starts: a refused transport leaves no thread, and no server of ours
            transport = build_server_transport(
                args.vllm_server_weight_transfer,
                accelerator=self.accelerator,
                client=client,
                weights_dtype=weights_dtype,
            )
            background_delivery = delivers_in_background(
                args.weight_delivery, transport, self.accelerator.num_processes
            )
        except Exception:
            if process is not None:
                process.stop()
            raise
        producer = RolloutProducer(
            prompt_for=self._producer_prompt,
            sampler=self._group_sampler(client),
            score=self._score_group,
            schedule=self._schedule,
            num_generations=self.num_generations,
            seed=args.seed,
            max_inflight_tasks=inflight,
            queue_maxsize=max(args.queue_maxsize, groups),
            seed_for=self._group_seed,
            ready=ready,
            gate=client.gate,  # each HTTP request counted, not each group: a reload waits for no tool
        )
        producer.start()
        try:  # several processes: the delivery store may fail to start (every rank raises it); leave no thread
            return build_engine(
                args,
                kind="server",
                model=self.model,
                accelerator=self.accelerator,
                processing_class=self.processing_class,
                phase_timer=self.phase_timer,
                client=client,
                producer=producer,
                schedule=self._schedule,
                policy_version=self._current_rollout,  # the schedule's count; rows get the policy version
                probe_ids=self._probe_ids(),
                verify_tolerance=self._verify_tolerance(),
                request_timeout=args.request_timeout,
                server_process=process,
                before_publish=self._prefetch_prompts,
                weights_dtype=weights_dtype,
                transport=transport,
                background_delivery=background_delivery,
            )
        except Exception:
            producer.close()
            if process is not None:
                process.stop()
            raise

    def _group_sampler(self, client: VLLMServerClient) -> Any:
        """What samples the producer's groups: whole episodes (a GymRollout), whole tool trajectories, or the
        client's single-turn groups."""
        if self._uses_gym_rollout():
            return self._gym_group_sampler(client, served_context(client))
        if self.tools:
            return self._tool_group_sampler(client)
        return client
