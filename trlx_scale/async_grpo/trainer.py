"""``AsyncGRPOTrainer``: GRPO with generation on vLLM servers overlapping training, within a staleness bound.

Why a subclass of trlx_scale's ``GRPOTrainer`` and not of TRL's experimental ``AsyncGRPOTrainer``: TRL's is built on
``_BaseTrainer``, not on ``GRPOTrainer``, runs its trainer on CUDA only (an FA3 kernel) and under FSDP2 only, and
has no off-policy correction. Built on ``GRPOTrainer`` the async trainer keeps every loss TRL's GRPO has
(``loss_type``, ``loss_recipe="gspo"``), the packed passes, the optimizer presets and fp32 masters, the profiler,
the non-finite guard, atomic checkpoints and the Hub push, and runs wherever ``GRPOTrainer`` runs (CPU, DDP,
ZeRO-3). What changes is where completions come from; a rollout, in numbered steps:

1. Before rollout ``t`` (``_generate_and_score_completions``), the servers get the weights of version ``t`` (every
   ``weight_sync_steps``-th; verified by a probe: ``generation.server_generation``), and the producer may start
   every group that version admits (``rollout.staleness``). The schedule counts rollouts: one per optimizer step
   by default, or one per ``optimizer_steps_per_rollout`` steps (``steps_per_generation`` mini-batches and
   ``num_iterations`` epochs over them, as in TRL); each row carries the trainer's ``policy_version`` of the
   weights that sampled it, which a skipped step does not advance (``rollout.policy_version.RolloutPolicyVersions``).
2. The producer (``rollout.async_producer``) has been sampling groups on the servers and scoring them with the
   reward functions off the training loop since their version was published. It knows each group's prompt before
   the trainer does (``rollout.prompt_stream`` replays TRL's sampler), and the trainer checks that the data
   loader's rows are those prompts.
3. TRL's rollout runs as in ``GRPOTrainer``: its call for completions returns the producer's next groups (with the
   engine's log-probs of the sampled tokens, pi_behave), its call for rewards returns the producer's rewards.
4. The off-policy correction is TRL's vLLM importance-sampling correction with pi_prox, the trainer's log-probs at
   the start of the rollout's training, as the old policy: the loss clips pi_theta / pi_prox and weighs each token
   by pi_prox / pi_behave, truncated or masked by ``vllm_importance_sampling_mode`` and its clip bounds (AReaL's
   decoupled objective: a test holds the trainer's loss and gradients to the objective's pure functions,
   ``tests/helpers/decoupled_objective.py``). With one optimizer step per rollout pi_theta = pi_prox and the clip never acts; with several
   (``num_iterations`` > 1, or ``steps_per_generation`` a multiple of ``gradient_accumulation_steps``) the later
   steps move pi_theta away from pi_prox and the trust region does. ``async/*`` metrics measure it.

The trainer's parts: the servers it starts and what they get (``async_server_launch``), the engine built at the
first rollout (``async_server_engine``), what the producer calls back for (``async_producer_feed``: prompts, seeds,
rewards), the window a checkpoint carries (``checkpoint_window``, a checkpoint part), the behaviour metrics
(``async_behaviour_metrics``), tools (``async_tool_loop``) and ``GymRollout`` episodes (``async_gym_rollout``); this
file hands TRL the producer's completions and rewards.

``max_staleness=0`` samples every group with the weights that train it: synchronous GRPO on a server. Seeds are the
colocated engine's (the run's seed, the step, the group's global row and its prompt), so it samples what
``GRPOTrainer`` samples.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather

from ..agents.gym_rollout import GymRollout
from ..compat import trl_trainer_state as trl_state
from ..compat.trl_generation_call import served_groups
from ..compat.trl_init_config import config_for_trl_init
from ..generation.colocated_engine_setup import check_vllm_only_options
from ..generation.server_generation import ServerGeneration
from ..grpo.trainer import GRPOTrainer
from ..rollout.batch import RolloutBatch
from ..rollout.collector import RolloutSamples
from ..rollout.policy_version import RolloutPolicyVersions
from ..rollout.prompt_stream import RankPromptStream
from ..rollout.reward_logs import REWARD_LOG_KEY, replay_reward_logs
from ..rollout.reward_processes import send_reward_functions_to_processes
from ..rollout.staleness import StalenessSchedule
from .behaviour_metrics import BehaviourMetrics
from .checkpoint_window import RolloutWindowCheckpoint
from .config import AsyncGRPOConfig
from .dynamic_sampling import AsyncDynamicSampling
from .gym_rollout import ServerGymRollout
from .producer_feed import ProducerFeed
from .server_engine import AsyncEngineBuilder
from .server_launch import AsyncServerStart
from .tool_loop import ServerToolLoop

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
        if rollout_func is not None and not isinstance(rollout_func, GymRollout):
            raise ValueError(
                "AsyncGRPOTrainer takes rollout_func=GymRollout(...) only (its episodes run in the producer, on the "
                "servers, ahead of the trainer); a custom rollout_func samples on the trainer's thread, when TRL "
                "calls it. Use tools, an environment_factory or a GymRollout, or GRPOTrainer for a custom rollout."
            )
        if reward_funcs is None:  # an environment's get_reward may be the only reward source (TRL checks there is one)
            functions = []
        else:
            functions = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        for function in functions:
            if not callable(function) or isinstance(function, torch.nn.Module):
                raise TypeError(
                    f"reward function {function!r}: AsyncGRPOTrainer scores off the training loop with callables "
                    "(TRL's signature, sync or async); load a reward model inside a function to use one."
                )
        # TRL builds its own vLLM client when use_vllm is on (for TRL's `trl vllm-serve`): it is handed a copy that
        # says use_vllm=False, and the server engine is built at the first rollout, when the resume point is known.
        trl_args = config_for_trl_init(args, use_vllm=False)
        # Its parts (each holds the trainer weakly): the servers it starts, the engine built at the first rollout,
        # what the producer calls back for, its tool trajectories and gym episodes, the behaviour metrics.
        self.server_start = AsyncServerStart(self)
        self.engine_builder = AsyncEngineBuilder(self)
        self.producer_feed = ProducerFeed(self)
        self.server_tools = ServerToolLoop(self)
        self.server_gym = ServerGymRollout(self)
        self.behaviour = BehaviourMetrics(self)
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
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        self.args.use_vllm = True
        self.use_vllm = True
        check_vllm_only_options(self)
        self.server_tools.check()
        self.server_gym.check()
        # TRL's list, with GRPOTrainer's guard around each synchronous function (reward_errors, non-finite rewards),
        # whose function runs in a worker process under async_reward_processes.
        self._async_reward_funcs = list(self.reward_funcs)
        self._reward_processes = send_reward_functions_to_processes(
            self.reward_funcs,
            self.args.async_reward_processes,
            environment_factory,
            rollout_func,
            "async_reward_processes",
        )
        trl_state.force_weight_sync(self)
        self.vllm_generation: ServerGeneration | None = None
        self._prompt_stream: RankPromptStream | None = None
        self._prompt_cache: dict[int, dict[str, Any]] = {}
        self._prompt_lock = threading.Lock()
        self._next_prefetch = 0
        self._schedule: StalenessSchedule | None = None
        self.rollout_window = RolloutWindowCheckpoint(self)  # saved with each checkpoint, continued on resume
        self.checkpoint_parts.register("rollout_window", self.rollout_window)
        self._rollout_policy_versions = RolloutPolicyVersions()
        self._inside_train = False  # evaluate() outside train() closes what it started

    # ---------------------------------------------------------------- the engine (built by engine_builder)
    def _rollout_engine(self):
        return self.vllm_generation

    # ---------------------------------------------------------------- GRPOTrainer's seams and TRL's hooks
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return self.server_tools.first_turns(
            super()._generate_single_turn,
            prompt_ids,
            images,
            multimodal_fields,
            num_generations,
            has_tool_images=has_tool_images,
        )

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        return self.server_tools.tool_call_loop(
            prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
        )

    def _resets_trl_environments(self) -> bool:
        return self.server_tools.resets_trl_environments()

    def _gym_rollout(self, gym, prompts: list) -> dict[str, list]:
        return self.server_gym.rollout(gym, prompts)

    def _sequence_weight_normalisation(self) -> str:
        return self.behaviour.sequence_weight_normalisation()

    def _deferred_correction(self, logps, inputs: dict) -> None:
        self.behaviour.deferred_correction(super()._deferred_correction, logps, inputs)

    # ---------------------------------------------------------------- the rollout
    def _generate_and_score_completions(self, inputs):
        if self.vllm_generation is None:
            self.vllm_generation = self.engine_builder.build()
            if self._reward_processes is not None:
                self._reward_processes.open()  # closed with the last engine
        rollout = self.producer_feed.current_rollout()
        # Evaluation, after step k: rollout k's weights are the trainer's current ones, sent now rather than at the
        # next rollout (the schedule is a function of the group alone: only the timing moves).
        self.vllm_generation.ensure_version(rollout, wait=not self.model.training)
        if self.model.training:
            self._prompt_stream.check_rollout(rollout, inputs)
        output = super()._generate_and_score_completions(inputs)
        if "old_per_token_logps" in output and "sampling_per_token_logps" in output:
            mask = output["completion_mask"]
            if "tool_mask" in output:  # tool results were not sampled: no behaviour log-prob to compare
                mask = mask * output["tool_mask"]
            self.behaviour.log(output["old_per_token_logps"], output["sampling_per_token_logps"], mask)
        return output

    def _build_dynamic_sampling(self) -> AsyncDynamicSampling:
        return AsyncDynamicSampling(self)

    def _rollout_has_images(self, inputs) -> bool:
        # Every rollout is the producer's, through the collector (the servers refuse images with a clear error).
        return False

    def _sample_rollout(self, prompts, rows) -> RolloutSamples:
        """TRL's driver took the producer's next groups from the server engine (``take_groups``): the samples are
        those groups (recorded in the generation call, ``compat.trl_generation_call``), each row with the policy
        version that sampled it (and each token with its own under ``full_weight_reload="keep"``). Evaluation's
        completions were sampled now, outside the producer."""
        samples = super()._sample_rollout(prompts, rows)
        if not self.model.training:
            return samples
        groups = served_groups(samples.groups, "TRL's _generate")
        sampled = [ids for group in groups for ids in group.sampled.completion_ids]
        if [list(ids) for ids in samples.completion_ids] != [list(ids) for ids in sampled]:
            raise RuntimeError("the completions TRL returned are not the producer's (the rollout's order changed).")
        samples.groups = groups
        samples.policy_versions = [
            RolloutPolicyVersions.of(group.sampled) for group in groups for _ in range(self.num_generations)
        ]
        if self.args.full_weight_reload == "keep":
            samples.token_policy_versions = [
                versions for group in groups for versions in RolloutPolicyVersions.of_tokens(group.sampled)
            ]
        return samples

    def _rollout_rewards(self, rows, prompts, samples: RolloutSamples) -> torch.Tensor:
        """The producer's rewards of this rollout's groups (scored off the training loop), gathered as TRL's; the
        producer's ``log_metric`` / ``log_extra`` calls replayed. Evaluation's completions: scored as
        ``GRPOTrainer`` scores them."""
        if samples.groups is None:
            return super()._rollout_rewards(rows, prompts, samples)
        with self.phase_timer.phase("reward"):
            local = torch.tensor(
                [rewards for group in samples.groups for rewards in group.rewards],
                dtype=torch.float32,
                device=self.accelerator.device,
            )
            replay_reward_logs(
                [group.sampled.extras[REWARD_LOG_KEY] for group in samples.groups],
                self._log_metric,
                self._log_completion_extra,
            )
            self._report_reward_errors()  # what the guard recorded while the producer scored, on every rank at once
            return gather(local)

    def _finish_rollout(self, batch: RolloutBatch) -> RolloutBatch:
        """``async/policy_version_lag_*``: how many weight updates behind the trainer's the weights that sampled each
        row are (the schedule's ``async/staleness_*`` counts rollouts, which a skipped step advances and the policy
        version does not); ``async/tokens_after_update_frac``. Evaluation's rows were sampled by the current weights:
        the trainer's version, as in ``GRPOTrainer``."""
        if not self.model.training:
            return super()._finish_rollout(batch)
        lag = (self.policy_version - self.accelerator.gather(batch.policy_version)).float()
        metrics = trl_state.metrics(self, "train")
        metrics["async/policy_version_lag_mean"].append(lag.mean().item())
        metrics["async/policy_version_lag_max"].append(lag.max().item())
        if batch.token_policy_version is not None:
            # The share of sampled tokens a reload reached inside their completion (sampled by newer weights than
            # the completion's first token).
            newer = (batch.token_policy_version > batch.policy_version[:, None]) * batch.completion_mask
            counts = self.accelerator.gather(torch.stack([newer.sum(), batch.completion_mask.sum()]).float()[None])
            share = counts[:, 0].sum() / counts[:, 1].sum().clamp(min=1)
            metrics["async/tokens_after_update_frac"].append(share.item())
        return super()._finish_rollout(batch)

    # ---------------------------------------------------------------- lifetime
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None):
        self._inside_train = True
        try:
            output = super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)
            if self.vllm_generation is not None:
                self.vllm_generation.finish_delivery()  # the last update failing fails the run, as inline
            return output
        finally:
            self._inside_train = False
            self.close_generation()

    def evaluate(self, *args, **kwargs) -> dict[str, float]:
        """Trainer's evaluation; one called outside ``train()`` stops the producer and the server it started."""
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            if not self._inside_train:
                self.close_generation()

    def close_generation(self) -> None:
        """Stop the producer and the server this trainer started (``train`` does it at the end)."""
        if self.vllm_generation is not None:
            self.vllm_generation.close()
            self._reward_scorer.close()
            if self._reward_processes is not None:
                self._reward_processes.close()  # reopened with the next engine
            self.server_tools.close()
            self.vllm_generation = None  # a later train() builds a new one
