"""``GRPOTrainer``: a drop-in subclass of ``trl.GRPOTrainer``.

Same constructor, same computation, while no trlx_scale option is on (the defaults that differ from TRL's, and why,
are listed in docs/defaults.md). The rollout path:

    engine (``generation.engine.RolloutEngine``: generate, at the trainer's policy version)
    -> ``rollout.RolloutBatch`` (TRL's rewards and advantages, then ``_finish_rollout``: PPO's values and GAE)
    -> log-prob pass (``passes``: padded or shared prefix, chosen once per run)
    -> TRL's loss (GSPO ratios from ``losses``; vLLM's correction from the loss pass)

Where each part lives (mixins placed before TRL's class in the bases):

- ``ColocatedEngineMixin``: trlx_scale's vLLM engine in the training processes, and TRL's single-turn generation on it;
- ``ConcurrentToolLoopMixin``: tool calling (``tools`` / ``environment_factory``), TRL's first turn, then each
  trajectory at its own pace (``tool_scheduling``); ``GymRolloutMixin``: gym-style episodes (``GymRollout``);
- ``LogProbPassesMixin``: the log-prob passes; ``LossPassCorrectionMixin``: vLLM's correction from the loss pass and
  GSPO-token's weights;
- ``RolloutBufferPart`` (a checkpoint part): a checkpoint inside a rollout's mini-batches resumes inside it;
- ``RankBalanceMixin``, ``PaddingFreeMixin``: samples dealt to ranks by cost, packed rows;
- ``TrainerFeatures`` (``trainer_features.py``): the cross-cutting features (profiler, non-finite guard, policy
  version, atomic checkpoints, Hub push, planned memory, fp32 masters).

This file: the constructor, the rewards (trlx_scale's scorer, the asynchronous producer's too: TRL's arguments, the
functions concurrently, guarded; TRL's own loop where a reward model is among them) and the rollout's
``RolloutBatch``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from accelerate.logging import get_logger
from accelerate.utils import gather
from trl import GRPOTrainer as TRLGRPOTrainer

from ..agents.colocated_gym_rollout import GymRolloutMixin
from ..agents.colocated_tool_loop import ConcurrentToolLoopMixin
from ..agents.environment_resets import EnvironmentResetMixin
from ..agents.gym_rollout import GymRollout
from ..compat import trl_trainer_state as trl_state
from ..generation.colocated_engine_setup import ColocatedEngineMixin
from ..generation.cpu_environment import configure_vllm_cpu_environment
from ..hub.secrets import check_tracker_uploads
from ..options import option
from ..passes.padding_free_choice import PaddingFreeMixin
from ..reliability.input_checks import GRPO_COLUMNS, check_dataset_columns, check_launch_matches, check_train_dataset
from ..reliability.reward_guard import guard_reward_functions, raise_reward_errors
from ..reliability.rollout_buffer_state import RolloutBufferPart
from ..rollout.batch import RolloutBatch
from ..rollout.collector import RolloutCollector, RolloutSamples
from ..rollout.rank_balance_step import RankBalanceMixin
from ..rollout.reward_scoring import TRL_REWARD_INPUTS, rollout_reward_scorer
from ..trainer_features import TrainerFeatures
from .config import GRPOConfig
from .logprob_passes import LogProbPassesMixin
from .loss_pass_correction import LossPassCorrectionMixin

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

trl_grpo_logger = get_logger("trl.trainer.grpo_trainer")  # the logger TRL's GRPOTrainer warns on


class GRPOTrainer(
    GymRolloutMixin,
    EnvironmentResetMixin,
    ConcurrentToolLoopMixin,
    LogProbPassesMixin,
    LossPassCorrectionMixin,
    ColocatedEngineMixin,
    RankBalanceMixin,
    PaddingFreeMixin,
    TrainerFeatures,
    TRLGRPOTrainer,
):
    """Group Relative Policy Optimization, as [`trl.GRPOTrainer`], with trlx_scale's scaling features.

    The constructor mirrors TRL's argument for argument (a contract test compares the signatures), so a script
    written for `trl.GRPOTrainer` runs unchanged with the import switched to `trlx_scale`. `args` may be a
    [`trlx_scale.GRPOConfig`] or a plain [`trl.GRPOConfig`] (then every trlx_scale option keeps its default).
    """

    _tag_names = ["trl", "grpo", "trlx-scale"]

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        reward_funcs: Any | list[Any] | None = None,
        args: GRPOConfig | None = None,
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
        colocate = args is not None and args.use_vllm and args.vllm_mode == "colocate"
        if colocate:
            configure_vllm_cpu_environment(option(args, "vllm_cpu_kvcache_space"))
            # TRL creates its own engine eagerly in __init__ and two engines must never start: TRL is handed a copy
            # of the config that says use_vllm=False (the caller's object is never changed), and our engine is
            # built right after (see _build_colocated_engine).
            args = copy.copy(args)
            args.use_vllm = False
        check_train_dataset(train_dataset)
        check_dataset_columns(train_dataset, GRPO_COLUMNS, type(self).__name__)
        check_dataset_columns(eval_dataset, GRPO_COLUMNS, type(self).__name__, "eval_dataset")
        if args is not None:
            check_launch_matches(args)
            check_tracker_uploads(args)
        if isinstance(rollout_func, GymRollout):
            if tools or environment_factory:
                raise ValueError(
                    "rollout_func=GymRollout(...) runs gym-style environments (reset/step); tools and "
                    "environment_factory run TRL's tool environments: pass one or the other."
                )
            reward_funcs = rollout_func.after_reward_funcs(reward_funcs, args)
        # Each synchronous reward function reports its failures on every rank (trlx_scale.reliability).
        reward_funcs = guard_reward_functions(reward_funcs, option(args, "reward_errors"))
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
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
        # TRL's reward functions, environments' get_reward included, as built by its constructor.
        self.checkpoint_parts.register("rollout_buffer", RolloutBufferPart(self))
        self._rollout_scorer = rollout_reward_scorer(self.reward_funcs, option(self.args, "reward_scoring"))
        # GSPO-token runs through TRL's "token" branch: its weights come from the loss pass's log-probs, shifted in
        # _postprocess_loss_logps (TRL reads this attribute only in _compute_loss; pinned by a contract test).
        self.uses_sequence_token_ratios = self.importance_sampling_level == "sequence_token"
        if self.uses_sequence_token_ratios:
            self.importance_sampling_level = "token"
        if colocate:
            self.args.use_vllm = True  # our copy: this run does generate with vLLM
            self.use_vllm = True
            self._check_vllm_only_options()
            self.vllm_generation = self._build_colocated_engine()
            # TRL's _generate_single_turn reads its own tag before calling sync_weights; the engine's sync is the
            # version comparison (ensure_version), so TRL's tag only saves a call per micro-batch.
            trl_state.force_weight_sync(self)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None):
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)
        finally:
            # The scorer's worker threads and event loop live only as long as a run: a later evaluate() or
            # train() starts them again.
            if self._rollout_scorer is not None:
                self._rollout_scorer.close()

    def _prepare_inputs(self, generation_batch):
        # TRL's rollout (generation, rewards, log-prob passes, advantages) runs here on generation steps; the parts
        # with a phase of their own are timed inside, the rest (decoding, gathers, advantages) is "rollout".
        with self.phase_timer.phase("rollout"):
            return super()._prepare_inputs(generation_batch)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        with self.phase_timer.phase("reward"):
            if self._rollout_scorer is None:  # reward_scoring="sequential", or a reward model: TRL's loop, in order
                rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            else:
                rewards_per_func = self._score_rollout(inputs, prompts, completions, completion_ids_list)
            self._report_reward_errors()
        return rewards_per_func

    def _rollout_rewards(self, rows, prompts, samples: RolloutSamples) -> torch.Tensor:
        """The collector's reward stage: (B_all, F), every process's rows (TRL's ``_calculate_rewards``: the seam a
        script's subclass of TRL's trainer overrides)."""
        return self._calculate_rewards(rows, prompts, samples.completions, samples.completion_ids)

    def _score_rollout(self, inputs, prompts, completions, completion_ids_list) -> torch.Tensor:
        """The rollout's rewards by trlx_scale's scorer (``rollout.reward_scoring``, the asynchronous producer's):
        TRL's arguments (the rows' other columns, ``trainer_state``, ``log_metric``, ``log_extra``, the
        environments), the reward functions concurrently; NaN for None; gathered as TRL gathers them."""
        columns = {key: [row[key] for row in inputs] for key in inputs[0] if key not in TRL_REWARD_INPUTS}
        if self.environments is not None:
            columns["environments"] = self.environments
        rows = self._rollout_scorer.score_now(
            prompts,
            completions,
            completion_ids_list,
            # What TRL passes; a snapshot, as the asynchronous producer's (the state the rollout was scored at).
            trainer_state=copy.copy(self.state),
            log_metric=self._log_metric,
            log_extra=self._log_completion_extra,
            **columns,
        )
        rewards = torch.tensor(rows, dtype=torch.float32, device=self.accelerator.device)
        if torch.isnan(rewards).all(dim=1).any():
            row = int(torch.isnan(rewards).all(dim=1).nonzero()[0, 0])
            row_kwargs = {key: values[row] for key, values in columns.items()}
            row_kwargs["prompt"], row_kwargs["completion"] = prompts[row], completions[row]
            # TRL's logger and words, so that a user's log filter or test keyed on TRL's warning still sees it.
            trl_grpo_logger.warning(
                f"All reward functions returned None for the following kwargs:\n{row_kwargs}\n"
                "Please ensure that at least one reward function returns a valid reward."
            )
        return gather(rewards)

    def _report_reward_errors(self) -> None:
        """The guarded reward functions' failures as the same error on every rank (call it at the same point on
        each); in skip mode, the count of samples scored NaN as ``reliability/reward_errors``; batch calls retried
        sample by sample as ``reliability/reward_retries``."""
        report = raise_reward_errors(self.reward_funcs, self.accelerator)
        metrics = trl_state.metrics(self, "train" if self.model.training else "eval")
        if option(self.args, "reward_errors") == "skip":
            metrics["reliability/reward_errors"].append(float(report.skipped))
        if report.retries:
            metrics["reliability/reward_retries"].append(float(report.retries))

    def _generate_and_score_completions(self, inputs):
        """TRL's hook for a rollout: trlx_scale's collector (``rollout.collector``) builds the ``RolloutBatch``,
        the algorithm adds its quantities (``_finish_rollout``), and TRL's loss gets it as TRL's dict."""
        version = self.policy_version  # the engine serves it for this rollout (ensure_version)
        if self._rollout_has_images(inputs):
            batch = self._trl_rollout(inputs, version)
        else:
            batch = RolloutCollector(self).collect(inputs, version)
        batch = self._finish_rollout(batch)
        # Then the samples are dealt to the ranks by cost where that leaves the loss unchanged (balance_ranks).
        return self._balance_ranks(batch.to_trl())

    def _rollout_has_images(self, inputs) -> bool:
        """Rows with images, or a vision-language model's tools (whose results may carry images): TRL's rollout."""
        return "images" in inputs[0] or "image" in inputs[0] or bool(trl_state.is_vlm(self) and self.tools)

    def _trl_rollout(self, inputs, version: int) -> RolloutBatch:
        """A rollout with image inputs, by TRL's ``_generate_and_score_completions`` (the processor's pixel inputs,
        tiles and token-type ids are model-specific), typed afterwards. Its rewards per function are the ones TRL
        logged for it (the last ``B_all`` values of each function's reward log: float32 values, exact)."""
        names = self.reward_func_names
        if len(set(names)) != len(names):
            raise ValueError(
                f"reward functions {names}: two share a name, and a rollout with images reads each one's rewards from "
                "TRL's reward log, which is keyed by name. Give each reward function a name of its own (a def, not "
                "two lambdas)."
            )
        if isinstance(self.rollout_func, GymRollout):
            raise ValueError(
                "rollout_func=GymRollout(...) runs text episodes, and this batch has images (an 'image' or 'images' "
                "column), which its episodes would drop: remove the image column, or train the vision-language "
                "model without GymRollout."
            )
        output = super()._generate_and_score_completions(inputs)
        rows_all = output["completion_ids"].size(0) * self.accelerator.num_processes
        logged = [list(trl_state.reward_logs(self)["rewards"][name])[-rows_all:] for name in names]
        if any(len(values) != rows_all for values in logged):
            raise ValueError(
                f"a rollout with images has {rows_all} rows, more than TRL's reward log keeps (generation_batch_size="
                f"{self.args.generation_batch_size}): lower per_device_eval_batch_size to at most "
                "per_device_train_batch_size * steps_per_generation."
            )
        rewards_per_func = torch.tensor(logged, dtype=torch.float32, device=self.accelerator.device).T
        return RolloutBatch.from_trl(
            output,
            rewards_per_func=rewards_per_func,
            policy_version=version,
            process_index=self.accelerator.process_index,
            rows=inputs,
        )

    def _finish_rollout(self, batch: RolloutBatch) -> RolloutBatch:
        """Seam: an algorithm adds its own per-rollout quantities to the batch TRL scored (PPO: KL-penalized rewards,
        values, GAE advantages; the RLOO example of docs/contributing.md: leave-one-out advantages)."""
        return batch

    def _planner_extra_roles(self) -> dict:
        return {"reference": self.beta != 0.0}  # TRL builds a reference model only for a KL term

    def _before_log(self) -> None:
        # The gap between vLLM's and the trainer's log-probs of the sampled tokens, right after a sync: TRL measures
        # it (as the importance-sampling diagnostic) whenever it computes the trainer's log-probs; it is exposed
        # under sync/ as the staleness check. Numerical noise when the engine is in sync; large when it is stale.
        mode = "train" if self.model.training else "eval"
        for source, target in (
            ("sampling/sampling_logp_difference/mean", "sync/logprob_gap_mean"),
            ("sampling/sampling_logp_difference/max", "sync/logprob_gap_max"),
        ):
            if trl_state.metrics(self, mode).get(source):
                trl_state.metrics(self, mode)[target] = list(trl_state.metrics(self, mode)[source])
