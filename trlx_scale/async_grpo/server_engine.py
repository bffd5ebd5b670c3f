"""``AsyncEngineBuilder``: ``AsyncGRPOTrainer``'s engine, built at the first rollout, when the resume point is known.

In order: the servers (``AsyncServerStart``: a URL given, or one the trainer starts, in the weights format
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
from ..trainer_part import TrainerPart
from .tool_loop import served_context


class AsyncEngineBuilder(TrainerPart):
    """Part of ``AsyncGRPOTrainer`` (see the module docstring)."""

    def build(self) -> ServerGeneration:
        args = self.trainer.args
        sync_mode = self.trainer.server_start.sync_mode()
        if sync_mode == "lora" and lora_ineligibility(self.trainer.model):
            sync_mode = "full"
        urls, process = self.trainer.server_start.start(sync_mode)
        client = VLLMServerClient(
            urls,
            model=self.trainer.server_start.base_model_path(),
            sampling=SamplingSettings(
                max_tokens=self.trainer.max_completion_length,
                temperature=self.trainer.temperature,
                top_p=self.trainer.top_p,
                top_k=self.trainer.top_k or 0,
                min_p=self.trainer.min_p or 0.0,
                repetition_penalty=self.trainer.repetition_penalty,
            ),
            request_timeout=args.request_timeout,
            lora=sync_mode == "lora",
            process=process,
            prompt_ids=lambda prompt: prompt["prompt_ids"],
            keep_requests_on_reload=args.full_weight_reload == "keep",
        )
        if self.trainer.accelerator.is_main_process:
            client.check_model(self.trainer.server_start.base_model_path())
        world, rank = self.trainer.accelerator.num_processes, self.trainer.accelerator.process_index
        rows = args.per_device_train_batch_size * args.steps_per_generation
        self.trainer._prompt_stream = RankPromptStream(
            self.trainer._get_train_sampler,
            self.trainer.train_dataset,
            rank=rank,
            world_size=world,
            rows_per_rollout=rows,
            num_generations=self.trainer.num_generations,
            repeat_count=self.trainer.num_iterations * args.steps_per_generation,
        )
        groups = self.trainer._prompt_stream.groups_per_rollout
        start = (
            self.trainer.producer_feed.current_rollout()
        )  # built at a rollout's start (or an evaluation between two)
        oldest, ready = self.trainer.rollout_window.continued_window(groups, start * groups)
        self.trainer._schedule = StalenessSchedule(
            groups_per_version=groups,
            max_staleness=args.max_staleness,
            weight_sync_steps=args.weight_sync_steps,
            start_index=start * groups,
            start_version=start,
            oldest_version=oldest,
        )
        self.trainer._next_prefetch = start * groups + len(ready)
        inflight = args.max_inflight_tasks if args.max_inflight_tasks > 0 else groups * (args.max_staleness + 1)
        self.trainer._reward_scorer = ConcurrentRewardScorer(
            self.trainer._async_reward_funcs, max_workers=args.async_reward_workers
        )
        self.trainer.producer_tokenizer = copy.deepcopy(
            self.trainer.processing_class
        )  # decoding off the trainer's thread
        # Full weights in the dtype of a server this trainer started; one the user started casts on load.
        weights_dtype = getattr(torch, self.trainer.server_start.dtype()) if process is not None else None
        try:  # before the producer starts: a refused transport leaves no thread, and no server of ours
            transport = build_server_transport(
                args.vllm_server_weight_transfer,
                accelerator=self.trainer.accelerator,
                client=client,
                weights_dtype=weights_dtype,
            )
            background_delivery = delivers_in_background(
                args.weight_delivery, transport, self.trainer.accelerator.num_processes
            )
        except Exception:
            if process is not None:
                process.stop()
            raise
        producer = RolloutProducer(
            prompt_for=self.trainer.producer_feed.producer_prompt,
            sampler=self.group_sampler(client),
            score=self.trainer.producer_feed.score_group,
            schedule=self.trainer._schedule,
            num_generations=self.trainer.num_generations,
            seed=args.seed,
            max_inflight_tasks=inflight,
            queue_maxsize=max(args.queue_maxsize, groups),
            seed_for=self.trainer.producer_feed.group_seed,
            ready=ready,
            gate=client.gate,  # each HTTP request counted, not each group: a reload waits for no tool
            replacement=None if self.trainer.dynamic_sampling is None else self.trainer.dynamic_sampling.replacement(),
        )
        producer.start()
        try:  # several processes: the delivery store may fail to start (every rank raises it); leave no thread
            return build_engine(
                args,
                kind="server",
                model=self.trainer.model,
                accelerator=self.trainer.accelerator,
                processing_class=self.trainer.processing_class,
                phase_timer=self.trainer.phase_timer,
                client=client,
                producer=producer,
                schedule=self.trainer._schedule,
                policy_version=self.trainer.producer_feed.current_rollout,  # the schedule's count; rows get the policy version
                probe_ids=self.trainer.server_start.probe_ids(),
                verify_tolerance=self.trainer.server_start.verify_tolerance(),
                request_timeout=args.request_timeout,
                server_process=process,
                before_publish=self.trainer.producer_feed.prefetch_prompts,
                weights_dtype=weights_dtype,
                transport=transport,
                background_delivery=background_delivery,
            )
        except Exception:
            producer.close()
            if process is not None:
                process.stop()
            raise

    def group_sampler(self, client: VLLMServerClient) -> Any:
        """What samples the producer's groups: whole episodes (a GymRollout), whole tool trajectories, or the
        client's single-turn groups."""
        if self.trainer.server_gym.uses_gym_rollout():
            return self.trainer.server_gym.group_sampler(client, served_context(client))
        if self.trainer.tools:
            return self.trainer.server_tools.group_sampler(client)
        return client
