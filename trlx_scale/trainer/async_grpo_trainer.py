"""``AsyncGRPOTrainer``: GRPO with generation on vLLM servers overlapping training, within a staleness bound.

Why a subclass of trlx_scale's ``GRPOTrainer`` and not of TRL's experimental ``AsyncGRPOTrainer``: TRL's is built on
``_BaseTrainer``, not on ``GRPOTrainer``, runs its trainer on CUDA only (an FA3 kernel) and under FSDP2 only, and
has no off-policy correction. Built on ``GRPOTrainer`` the async trainer keeps every loss TRL's GRPO has
(``loss_type``, ``loss_recipe="gspo"``), the packed passes, the optimizer presets and fp32 masters, the profiler,
the non-finite guard, atomic checkpoints and the Hub push, and runs wherever ``GRPOTrainer`` runs (CPU, DDP,
ZeRO-3). What changes is where completions come from; a rollout, in numbered steps:

1. Before rollout ``t`` (``_generate_and_score_completions``), the servers get the weights of version ``t`` (every
   ``weight_sync_steps``-th; verified by a probe: ``generation.server_generation``), and the producer may start
   every group that version admits (``rollout.staleness``). The version is the rollout count: one rollout per
   optimizer step (``AsyncGRPOConfig`` checks ``steps_per_generation == gradient_accumulation_steps``).
2. The producer (``rollout.async_producer``) has been sampling groups on the servers and scoring them with the
   reward functions off the training loop since their version was published. It knows each group's prompt before
   the trainer does (``rollout.prompt_stream`` replays TRL's sampler), and the trainer checks that the data
   loader's rows are those prompts.
3. TRL's rollout runs as in ``GRPOTrainer``: its call for completions returns the producer's next groups (with the
   engine's log-probs of the sampled tokens, pi_behave), its call for rewards returns the producer's rewards.
4. The off-policy correction is TRL's vLLM importance-sampling correction with pi_prox, the trainer's log-probs at
   the start of the step, as the old policy: the loss clips pi_theta / pi_prox and weighs each token by
   pi_prox / pi_behave, truncated or masked by ``vllm_importance_sampling_mode`` and its clip bounds (AReaL's
   decoupled objective; ``losses/decoupled_objective.py`` is its reference). ``async/*`` metrics measure it.

``max_staleness=0`` samples every group with the weights that train it: synchronous GRPO on a server. Seeds are the
colocated engine's (the run's seed, the step, the group's global row and its prompt), so it samples what
``GRPOTrainer`` samples.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import broadcast_object_list, gather
from trl.data_utils import is_conversational

from ..generation.cpu_environment import running_on_cpu_only
from ..generation.rollout_seeds import RolloutSeedContext, request_seed
from ..generation.server_client import SamplingSettings, VLLMServerClient
from ..generation.server_generation import ServerGeneration
from ..generation.vllm_server import ServerLaunch, VLLMServerProcess
from ..generation.weight_sync import choose_sync_mode, lora_ineligibility, vllm_max_lora_rank
from ..losses.decoupled_objective import behaviour_kl
from ..losses.vllm_importance_sampling import is_sequence_level, vllm_importance_sampling_ratio
from ..options import option
from ..peft_models import is_peft_model
from ..reliability.rank_agreement import failing_together
from ..rollout.async_producer import GroupRequest, RolloutProducer, SampledGroup
from ..rollout.batch import RolloutBatch
from ..rollout.prompt_stream import RankPromptStream
from ..rollout.reward_logs import REWARD_LOG_KEY, GroupRewardLog, replay_reward_logs
from ..rollout.reward_scoring import ConcurrentRewardScorer
from ..rollout.rollout_window import WINDOW_STATE_NAME, load_window, save_window, window_mismatch
from ..rollout.staleness import StalenessSchedule
from .async_grpo_config import AsyncGRPOConfig
from .grpo_trainer import GRPOTrainer

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
    from peft import PeftConfig, PeftModel
    from transformers import (
        BitsAndBytesConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        ProcessorMixin,
        TrainerCallback,
    )

logger = logging.getLogger(__name__)

PROBE_TOKENS = 8  # completion tokens appended to the probe prompt (any tokens: their log-probs are compared)


class AsyncGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with asynchronous generation on vLLM servers (see the module docstring). Same constructor;
    ``args`` is an ``AsyncGRPOConfig``; reward functions are callables (TRL's signature, sync or async)."""

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        reward_funcs: Any | list[Any] | None = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset
        | IterableDataset
        | DatasetDict
        | IterableDatasetDict
        | dict[str, Dataset | IterableDataset]
        | None = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        reward_processing_classes: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        quantization_config: BitsAndBytesConfig | None = None,
        peft_config: PeftConfig | None = None,
        tools: list[Callable] | None = None,
        rollout_func: Any | None = None,
        environment_factory: Any | None = None,
    ):
        if not isinstance(args, AsyncGRPOConfig):
            raise TypeError(
                f"AsyncGRPOTrainer needs an AsyncGRPOConfig (got {type(args).__name__}): "
                "from trlx_scale import AsyncGRPOConfig."
            )
        for name, value in (
            ("tools", tools),
            ("rollout_func", rollout_func),
            ("environment_factory", environment_factory),
        ):
            if value is not None:
                raise ValueError(
                    f"AsyncGRPOTrainer does not take {name} yet: the producer samples single-turn completions on the "
                    "server. Use GRPOTrainer for tool calling and custom rollouts."
                )
        functions = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        for function in functions:
            if not callable(function) or isinstance(function, torch.nn.Module):
                raise TypeError(
                    f"reward function {function!r}: AsyncGRPOTrainer scores off the training loop with callables "
                    "(TRL's signature, sync or async); load a reward model inside a function to use one."
                )
        # TRL builds its own vLLM client when use_vllm is on (for TRL's `trl vllm-serve`): it is handed a copy that
        # says use_vllm=False (the caller's object is never changed), and the server engine is built at the first
        # rollout, when the resume point is known.
        trl_args = copy.copy(args)
        trl_args.use_vllm = False
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=trl_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self.args.use_vllm = True
        self.use_vllm = True
        self._check_vllm_only_options()
        # TRL's list, with GRPOTrainer's guard around each synchronous function (reward_errors, non-finite rewards).
        self._async_reward_funcs = list(self.reward_funcs)
        self._last_loaded_step = -1
        self.vllm_generation: ServerGeneration | None = None
        self._prompt_stream: RankPromptStream | None = None
        self._prompt_cache: dict[int, dict[str, Any]] = {}
        self._prompt_lock = threading.Lock()
        self._next_prefetch = 0
        self._schedule: StalenessSchedule | None = None
        self._resume_window: tuple[dict[str, int], list] | None = None  # read from a checkpoint on resume

    # ---------------------------------------------------------------- the engine, built at the first rollout
    def _rollout_engine(self):
        return self.vllm_generation

    def _planner_engine(self):
        """No engine in the training processes: the servers run on their own devices (docs/async.md)."""
        return None

    def _server_sync_mode(self) -> str:
        if not is_peft_model(self.model):
            return "full"
        mode, _ = choose_sync_mode(self.model, option(self.args, "vllm_sync_mode"), cpu_engine=running_on_cpu_only())
        return mode

    def _server_dtype(self) -> str:
        if self.args.bf16:
            return "bfloat16"
        if self.args.fp16:
            return "float16"
        return str(self.accelerator.unwrap_model(self.model).dtype).removeprefix("torch.")

    def _base_model_path(self) -> str:
        model = self.accelerator.unwrap_model(self.model)
        base = model.get_base_model() if is_peft_model(model) else model
        return base.name_or_path

    def _start_server(self, sync_mode: str) -> tuple[list[str], VLLMServerProcess | None]:
        urls = self.args.server_urls
        process = None
        if not urls:
            if self.accelerator.is_main_process:
                rank = None
                if sync_mode == "lora":
                    config = self.accelerator.unwrap_model(self.model).active_peft_config
                    rank = vllm_max_lora_rank(max([config.r, *(config.rank_pattern or {}).values()]))
                launch = ServerLaunch(
                    model=self._base_model_path(),
                    dtype=self._server_dtype(),
                    enable_lora=sync_mode == "lora",
                    max_loras=self.args.max_staleness + 2,
                    max_lora_rank=rank or 16,
                    seed=self.args.seed,
                    max_model_len=self.args.vllm_max_model_length,
                    devices=self.args.vllm_server_devices,
                )
                process = VLLMServerProcess(launch, startup_timeout=self.args.vllm_server_timeout).start()
                urls = [launch.url]
            urls = broadcast_object_list([urls])[0] if self.accelerator.num_processes > 1 else urls
        return urls, process

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
        start = self.state.global_step
        oldest, ready = self._continued_window(groups, start * groups)
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
        producer = RolloutProducer(
            prompt_for=self._producer_prompt,
            sampler=client,
            score=self._score_group,
            schedule=self._schedule,
            num_generations=self.num_generations,
            seed=args.seed,
            max_inflight_tasks=inflight,
            queue_maxsize=max(args.queue_maxsize, groups),
            seed_for=self._group_seed,
            ready=ready,
        )
        producer.start()
        engine = ServerGeneration(
            model=self.model,
            accelerator=self.accelerator,
            client=client,
            producer=producer,
            schedule=self._schedule,
            policy_version=lambda: self.state.global_step,
            probe_ids=self._probe_ids(),
            verify_tolerance=self._verify_tolerance(),
            request_timeout=args.request_timeout,
            server_process=process,
            before_publish=self._prefetch_prompts,
            # Full weights in the dtype of a server this trainer started; one the user started casts on load.
            weights_dtype=getattr(torch, self._server_dtype()) if process is not None else None,
        )
        engine.phase_timer = self.phase_timer
        return engine

    # ---------------------------------------------------------------- checkpoints: the staleness window
    def _window_settings(self, groups: int, next_index: int, oldest_version: int) -> dict[str, int]:
        """What decides the schedule and the samples: a saved window continues a run only if they are the same."""
        return {
            "seed": self.args.seed,
            "world_size": self.accelerator.num_processes,
            "num_generations": self.num_generations,
            "groups_per_version": groups,
            "max_staleness": self.args.max_staleness,
            "weight_sync_steps": self.args.weight_sync_steps,
            "next_index": next_index,
            "oldest_version": oldest_version,
        }

    def _continued_window(self, groups: int, start_index: int) -> tuple[int, list]:
        """The oldest version and the groups queued first: a resumed run continues its checkpoint's window (the
        interrupted run's schedule, bit for bit); without one (a fresh run, a checkpoint saved with
        save_only_model, changed settings) the servers start from the checkpoint's weights alone."""
        start = start_index // groups
        if self._resume_window is None:
            return start, []
        saved, window = self._resume_window
        self._resume_window = None
        why = window_mismatch(saved, self._window_settings(groups, start_index, saved["oldest_version"]))
        if why is not None:
            logger.warning(
                "The checkpoint's rollout window does not fit this run (%s): the groups the interrupted run had "
                "sampled from older versions are sampled again from the checkpoint's weights.",
                why,
            )
            return start, []
        return int(saved["oldest_version"]), window

    def _save_extra_state(self, checkpoint_dir: str) -> None:
        """Each rank saves its staleness window: the groups sampled (or admitted) by versions older than the
        checkpoint's weights, waited for first (``rollout.rollout_window``)."""
        super()._save_extra_state(checkpoint_dir)
        engine = self.vllm_generation
        if engine is None:  # no rollout yet: nothing was sampled
            return
        groups, oldest = self._checkpoint_window(engine.producer)
        settings = self._window_settings(self._schedule.groups_per_version, engine.producer.next_index, oldest)
        path = os.path.join(checkpoint_dir, WINDOW_STATE_NAME.format(self.accelerator.process_index))
        save_window(path, groups, settings)

    def _checkpoint_window(self, producer: RolloutProducer) -> tuple[list, int]:
        """The groups a checkpoint carries and the oldest version its schedule continues from. A regular save waits
        for every admitted group (up to request_timeout). A preemption's waits what is left of
        ``preemption_grace_period``; if any rank's window is still incomplete then, every rank saves none (their
        schedules must agree): the resumed run samples those groups again, seeded as before, from the checkpoint's
        weights, and the requests in flight are cancelled when training stops."""
        since = self._seconds_since_preemption()
        what = "waiting for the rollout window of the checkpoint"
        if since is None:
            with failing_together(self.accelerator, what):
                return producer.admitted_groups(timeout=self.args.request_timeout), self._schedule.oldest_version
        grace = max(0.0, self.args.preemption_grace_period - since)
        with failing_together(self.accelerator, what):
            groups = producer.admitted_groups(timeout=grace, partial=True)
            missing = producer.admitted_count() - len(groups)
        if not self._any_rank(missing > 0):
            return groups, self._schedule.oldest_version
        logger.warning(
            "Preempted: %d of this rank's groups were still in flight after the %.0f s grace period "
            "(preemption_grace_period); they are cancelled, and the resumed run samples them again from the "
            "checkpoint's weights.",
            missing,
            self.args.preemption_grace_period,
        )
        return [], self.state.global_step

    def _load_extra_state(self, checkpoint_dir: str) -> None:
        super()._load_extra_state(checkpoint_dir)
        path = os.path.join(checkpoint_dir, WINDOW_STATE_NAME.format(self.accelerator.process_index))
        if os.path.isfile(path):
            self._resume_window = load_window(path)
        elif self.args.max_staleness > 0:
            logger.warning(
                "%s is missing: the groups the interrupted run had sampled from older versions are sampled again "
                "from the checkpoint's weights (inside the bound, not bit for bit the interrupted run).",
                path,
            )

    def _verify_tolerance(self) -> float:
        if self.args.weight_sync_verify_tolerance is not None:
            return self.args.weight_sync_verify_tolerance
        return 1e-3 if self._server_dtype() == "float32" else 0.1

    def _probe_ids(self) -> list[int]:
        """A probe sequence: the first training prompt and a few tokens (the same on every rank)."""
        prompt = self.train_dataset[0]["prompt"]
        ids = list(self._tokenize_prompts([prompt])[0][0])
        vocab = self.accelerator.unwrap_model(self.model).config.vocab_size
        return ids + [(ids[i % len(ids)] + i) % vocab for i in range(PROBE_TOKENS)]

    # ---------------------------------------------------------------- what the producer calls
    def _prefetch_prompts(self, version: int) -> None:
        """On the trainer's thread, before ``version`` is published: the rows and token ids of every group that
        version admits (the producer's thread never tokenizes: the tokenizer is not thread-safe)."""
        entries = {}
        while self._schedule.sampled_at(self._next_prefetch) <= version:
            row = self._prompt_stream.group(self._next_prefetch)
            entries[self._next_prefetch] = {
                "row": row,
                "prompt_ids": list(self._tokenize_prompts([row["prompt"]])[0][0]),
                # What TRL passes reward functions as `trainer_state`, fixed when the group is admitted: the producer
                # scores while the trainer's own state moves on.
                "trainer_state": copy.copy(self.state),
            }
            self._next_prefetch += 1
        with self._prompt_lock:
            self._prompt_cache.update(entries)

    def _producer_prompt(self, index: int) -> dict[str, Any]:
        with self._prompt_lock:
            return self._prompt_cache.pop(index)

    def _group_seed(self, index: int, version: int, prompt: dict[str, Any]) -> int:
        """The colocated engine's seed for this group's request: the run's seed, the step that trains it, the
        group's first row in the step's global batch and its prompt (``rollout_seeds``)."""
        groups = self._prompt_stream.groups_per_rollout
        rows = self._prompt_stream.rows_per_rollout
        rank = self.accelerator.process_index
        context = RolloutSeedContext(self.args.seed, rank, self._schedule.trained_at(index), "train")
        return request_seed(context, prompt["prompt_ids"], rank * rows + (index % groups) * self.num_generations)

    async def _score_group(self, request: GroupRequest, sampled: SampledGroup) -> list[list[float]]:
        row = request.prompt["row"]
        size = len(sampled.completion_ids)
        texts = self._producer_tokenizer.batch_decode(sampled.completion_ids, skip_special_tokens=True)
        if is_conversational({"prompt": row["prompt"]}):
            completions = [[{"role": "assistant", "content": text}] for text in texts]
        else:
            completions = texts
        columns = {key: [value] * size for key, value in row.items() if key not in ("prompt", "completion")}
        log = GroupRewardLog(size)  # replayed at the step that trains the group (rollout/reward_logs.py)
        sampled.extras[REWARD_LOG_KEY] = log
        return await self._reward_scorer.score(
            [row["prompt"]] * size,
            completions,
            sampled.completion_ids,
            trainer_state=request.prompt["trainer_state"],
            log_metric=log.log_metric,
            log_extra=log.log_extra,
            **columns,
        )

    # ---------------------------------------------------------------- the rollout
    def _generate_and_score_completions(self, inputs):
        if self.vllm_generation is None:
            self.vllm_generation = self._build_server_engine()
        rollout = self.state.global_step
        self.vllm_generation.ensure_version(rollout)
        self._prompt_stream.check_rollout(rollout, inputs)
        output = super()._generate_and_score_completions(inputs)
        if "old_per_token_logps" in output and "sampling_per_token_logps" in output:
            mask = output["completion_mask"]
            self._log_behaviour(output["old_per_token_logps"], output["sampling_per_token_logps"], mask)
        return output

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """The producer's rewards of this rollout's groups (computed off the training loop), gathered as TRL's."""
        groups = self.vllm_generation.last_groups
        sampled = [ids for group in groups for ids in group.sampled.completion_ids]
        if [list(ids) for ids in completion_ids_list] != [list(ids) for ids in sampled]:
            raise RuntimeError("the completions TRL scored are not the producer's (the rollout's order changed).")
        local = torch.tensor(
            [rewards for group in groups for rewards in group.rewards],
            dtype=torch.float32,
            device=self.accelerator.device,
        )
        replay_reward_logs(
            [group.sampled.extras[REWARD_LOG_KEY] for group in groups], self._log_metric, self._log_completion_extra
        )
        self._report_reward_errors()  # what the guard recorded while the producer scored, on every rank at once
        rewards_per_func = gather(local)
        self._rollout_rewards = rewards_per_func
        return rewards_per_func

    def _finish_rollout(self, batch: RolloutBatch) -> RolloutBatch:
        """Every row carries the version that sampled it."""
        versions = [
            group.sampled.version for group in self.vllm_generation.last_groups for _ in range(self.num_generations)
        ]
        batch.policy_version = torch.tensor(versions, dtype=torch.long, device=batch.completion_ids.device)
        return super()._finish_rollout(batch)

    def _deferred_correction(self, logps: torch.Tensor, inputs: dict) -> None:
        had = "importance_sampling_ratio" in inputs
        super()._deferred_correction(logps, inputs)
        if not had and "importance_sampling_ratio" in inputs:
            mask = inputs["completion_mask"]
            self._log_behaviour(logps.detach(), inputs["sampling_per_token_logps"], mask)

    def _log_behaviour(self, prox: torch.Tensor, behave: torch.Tensor, mask: torch.Tensor) -> None:
        """``async/sampler_trainer_kl`` (k3 estimate of KL(pi_behave || pi_prox) per token) and
        ``async/behaviour_weight_clip_frac``: the share of tokens (sequences, in a sequence mode) whose weight
        pi_prox / pi_behave the correction's bounds changed (truncated or masked)."""
        mask = mask.to(prox.dtype)
        behave = torch.nan_to_num(behave, nan=0.0)
        mode = self.vllm_importance_sampling_mode
        bounded = vllm_importance_sampling_ratio(
            prox, behave, mask, mode, self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        )
        difference = (prox - behave) * mask
        sequence = is_sequence_level(mode)
        raw = torch.exp(difference.sum(-1, keepdim=True) if sequence else difference)
        changed = (raw != bounded).to(mask.dtype)
        if sequence:
            counted = (mask.sum(-1, keepdim=True) > 0).to(mask.dtype)
            fraction = (changed * counted).sum() / counted.sum().clamp(min=1.0)
        else:
            fraction = (changed * mask).sum() / mask.sum().clamp(min=1.0)
        stats = torch.stack([behaviour_kl(prox, behave, mask), fraction])
        stats = self.accelerator.gather(stats.unsqueeze(0)).mean(0)
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["async/sampler_trainer_kl"].append(stats[0].item())
        metrics["async/behaviour_weight_clip_frac"].append(stats[1].item())

    # ---------------------------------------------------------------- lifetime
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.close_generation()

    def close_generation(self) -> None:
        """Stop the producer and the server this trainer started (``train`` does it at the end)."""
        if self.vllm_generation is not None:
            self.vllm_generation.close()
            self._reward_scorer.close()
            self.vllm_generation = None  # a later train() builds a new one
