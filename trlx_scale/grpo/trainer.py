"""``GRPOTrainer``: a drop-in subclass of ``trl.GRPOTrainer``.

Same constructor, same computation, while no trlx_scale option is on (the defaults that differ from TRL's, and why,
are listed in docs/defaults.md). The rollout path:

    engine (``generation.engine.RolloutEngine``: generate, at the trainer's policy version)
    -> ``rollout.RolloutBatch`` (TRL's rewards and advantages, then ``_finish_rollout``: PPO's values and GAE)
    -> log-prob pass (``passes``: padded or shared prefix, chosen once per run)
    -> TRL's loss (GSPO ratios from ``losses``; vLLM's correction from the loss pass)

Where each part lives (components the trainer holds, built in ``__init__``, or functions of the trainer):

- ``generation.colocated_engine_setup``: trlx_scale's vLLM engine in the training processes, and TRL's single-turn
  generation on it (``_generate_single_turn``);
- ``tool_loop`` (``agents.colocated_tool_loop.ColocatedToolLoop``): tool calling (``tools`` / ``environment_factory``),
  TRL's first turn, then each trajectory at its own pace (``tool_scheduling``) under the rules of
  ``agents.trajectory_rules``; ``gym_rollout`` (``agents.colocated_gym_rollout``): gym-style episodes
  (``GymRollout``);
- ``logprob_passes`` (``grpo.logprob_passes.LogProbPasses``): the pass each batch runs; vLLM's correction from the loss
  pass (``grpo.loss_pass_correction``) and GSPO-token's weights at the seams here;
- ``RolloutBufferPart`` (a checkpoint part): a checkpoint inside a rollout's mini-batches resumes inside it;
- ``rank_balance`` (``rollout.rank_balance_step.RankBalance``): samples dealt to ranks by cost;
- ``TrainerFeatures`` (``trainer_features.py``): the cross-cutting features (profiler, non-finite guard, policy
  version, atomic checkpoints, Hub push, planned memory, fp32 masters).

This file: the constructor, the rewards (trlx_scale's scorer, the asynchronous producer's too: TRL's arguments, the
functions concurrently, guarded; TRL's own loop where a reward model is among them) and the rollout's
``RolloutBatch``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import trl
from accelerate.logging import get_logger
from accelerate.utils import gather
from trl import GRPOTrainer as TRLGRPOTrainer

from ..agents.colocated_gym_rollout import ColocatedGymRollout
from ..agents.colocated_tool_loop import ColocatedToolLoop
from ..agents.environment_resets import rollout_prompts
from ..agents.gym_rollout import GymRollout
from ..compat import trl_trainer_state as trl_state
from ..compat.trl_generation_call import generation_call
from ..compat.trl_init_config import config_for_trl_init
from ..compat.trl_loss_pass import current_loss_pass, loss_pass_of
from ..generation.colocated_engine_setup import build_colocated_engine, check_vllm_only_options, generate_single_turn
from ..generation.cpu_environment import configure_vllm_cpu_environment
from ..generation.engine import RolloutEngine
from ..hub.secrets import check_tracker_uploads
from ..losses.policy_losses import log_importance_weights
from ..passes import PassRequest
from ..reliability.input_checks import GRPO_COLUMNS, check_dataset_columns, check_launch_matches, check_train_dataset
from ..reliability.reward_guard import guard_reward_functions, raise_reward_errors
from ..reliability.rollout_buffer_state import RolloutBufferPart
from ..rollout.batch import RolloutBatch
from ..rollout.collector import RolloutCollector, RolloutSamples
from ..rollout.rank_balance_step import RankBalance
from ..rollout.reward_scoring import TRL_REWARD_INPUTS, rollout_reward_scorer
from ..trainer_features import TrainerFeatures
from ..trl_config_upgrade import trainer_config
from .config import GRPOConfig
from .dynamic_sampling import DynamicSampling
from .logprob_passes import LogProbPasses
from .loss_pass_correction import deferred_correction
from .overlong_penalty import with_overlong_penalty

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
    TrainerFeatures,
    TRLGRPOTrainer,
):
    """Group Relative Policy Optimization, as [`trl.GRPOTrainer`], with trlx_scale's scaling features.

    The constructor mirrors TRL's argument for argument (a contract test compares the signatures), so a script
    written for `trl.GRPOTrainer` runs unchanged with the import switched to `trlx_scale`. `args` may be a
    [`trlx_scale.GRPOConfig`] or a plain [`trl.GRPOConfig`] (then the trainer runs with a `trlx_scale.GRPOConfig`
    holding its values, every trlx_scale field at what a plain TRL config means: docs/defaults.md).
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
        # A plain trl.GRPOConfig (or None) becomes ours, every trlx_scale field at what a plain TRL config means.
        args = trainer_config(args, model, GRPOConfig, trl.GRPOConfig, "GRPO")
        colocate = args.use_vllm and args.vllm_mode == "colocate"
        if colocate:
            configure_vllm_cpu_environment(args.vllm_cpu_kvcache_space)
            # TRL creates its own engine eagerly in __init__ and two engines must never start: TRL is handed a copy
            # of the config that says use_vllm=False, and our engine is built right after (build_colocated_engine).
            args = config_for_trl_init(args, use_vllm=False)
        check_train_dataset(train_dataset)
        check_dataset_columns(train_dataset, GRPO_COLUMNS, type(self).__name__)
        check_dataset_columns(eval_dataset, GRPO_COLUMNS, type(self).__name__, "eval_dataset")
        check_launch_matches(args)
        check_tracker_uploads(args)
        if isinstance(rollout_func, GymRollout):
            if tools or environment_factory:
                raise ValueError(
                    "rollout_func=GymRollout(...) runs gym-style environments (reset/step); tools and "
                    "environment_factory run TRL's tool environments: pass one or the other."
                )
            reward_funcs = rollout_func.after_reward_funcs(reward_funcs, args)
        # DAPO's soft overlong punishment, a reward column of its own (grpo.overlong_penalty).
        reward_funcs, reward_processing_classes, weights = with_overlong_penalty(
            reward_funcs, reward_processing_classes, args
        )
        if weights:
            args = config_for_trl_init(args, **weights)
        # Each synchronous reward function reports its failures on every rank (trlx_scale.reliability).
        reward_funcs = guard_reward_functions(reward_funcs, args.reward_errors)
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
        self.rank_balance = RankBalance(self)
        self.logprob_passes = LogProbPasses(self)
        self.tool_loop = ColocatedToolLoop(self)
        self.gym_rollout = ColocatedGymRollout(self)
        # DAPO's dynamic sampling: training rollouts of informative groups only (grpo.dynamic_sampling).
        self.dynamic_sampling = self._build_dynamic_sampling() if self.args.dynamic_sampling else None
        self._rollout_scorer = rollout_reward_scorer(self.reward_funcs, self.args.reward_scoring)
        # GSPO-token runs through TRL's "token" branch: its weights come from the loss pass's log-probs, shifted in
        # _postprocess_loss_logps (TRL reads this attribute only in _compute_loss; pinned by a contract test).
        self.uses_sequence_token_ratios = self.importance_sampling_level == "sequence_token"
        if self.uses_sequence_token_ratios:
            self.importance_sampling_level = "token"
        if colocate:
            self.args.use_vllm = True  # our copy: this run does generate with vLLM
            self.use_vllm = True
            check_vllm_only_options(self)
            self.vllm_generation = build_colocated_engine(self)
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

    def _rollout_prompts(self, rows: list[dict[str, Any]]) -> list:
        """The collector's prompt stage: the rows' prompts, with their environments drawn and reset
        (``agents.environment_resets``)."""
        return rollout_prompts(self, rows)

    def _resets_trl_environments(self) -> bool:
        """Seam: whether TRL's environment instances are reset for this rollout (False: the rollout does not use
        them: the asynchronous producer resets its own)."""
        return True

    def _sample_rollout(self, prompts: list, rows: list[dict[str, Any]]) -> RolloutSamples:
        """The collector's sampling stage: TRL's generation driver ``_generate`` on the rollout's prompts, inside a
        generation call that carries their rows (to a ``GymRollout``) and collects the groups a server engine hands
        out (``compat.trl_generation_call``)."""
        with generation_call(rows) as call:
            samples = RolloutSamples(*self._generate(prompts))
        samples.groups = call.groups or None
        return samples

    def _gym_rollout(self, gym: GymRollout, prompts: list) -> dict[str, list]:
        """What ``GymRollout`` (TRL's ``rollout_func``) calls: its episodes on this trainer's engine."""
        return self.gym_rollout.run(gym, prompts)

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
        if self.args.reward_errors == "skip":
            metrics["reliability/reward_errors"].append(float(report.skipped))
        if report.retries:
            metrics["reliability/reward_retries"].append(float(report.retries))

    # ---------------------------------------------------------------- generation
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return generate_single_turn(
            self,
            super()._generate_single_turn,
            prompt_ids,
            images,
            multimodal_fields,
            num_generations,
            has_tool_images=has_tool_images,
        )

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        # Each trajectory at its own pace (tool_scheduling="concurrent"), else TRL's lockstep loop.
        return self.tool_loop.run(
            super()._tool_call_loop,
            prompts,
            prompt_ids,
            completion_ids,
            completions,
            logprobs,
            images,
            multimodal_fields,
        )

    def _rollout_engine(self) -> RolloutEngine | None:
        """trlx_scale's engine, when this run generates with it (not with TRL's transformers path or server)."""
        engine = getattr(self, "vllm_generation", None)
        return engine if isinstance(engine, RolloutEngine) else None

    def _policy_engine(self) -> RolloutEngine | None:
        return self._rollout_engine()

    # ---------------------------------------------------------------- the log-prob passes and the loss
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        pixel_values=None,
        image_grid_thw=None,
        num_images=None,
        pixel_attention_mask=None,
        spatial_shapes=None,
        num_tiles=None,
        image_sizes=None,
        token_type_ids=None,
        mm_token_type_ids=None,
        image_position_ids=None,
    ):
        request = PassRequest(
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size,
            compute_entropy,
            compute_aux_loss,
            extra_inputs=dict(
                pixel_values=pixel_values,
                image_grid_thw=image_grid_thw,
                num_images=num_images,
                pixel_attention_mask=pixel_attention_mask,
                spatial_shapes=spatial_shapes,
                num_tiles=num_tiles,
                image_sizes=image_sizes,
                token_type_ids=token_type_ids,
                mm_token_type_ids=mm_token_type_ids,
                image_position_ids=image_position_ids,
            ),
        )
        training = torch.is_grad_enabled()
        # A no-grad pass is a rollout's old-policy or reference pass (the loss pass's time is its own phase).
        name = "ref_logprobs" if not training and self.logprob_passes.is_reference_pass(model) else "old_logprobs"
        with self.phase_timer.phase(name) if not training else contextlib.nullcontext():
            passes = self.logprob_passes.choose(model, request, super()._get_per_token_logps_and_entropies)
            result = passes.run(model, request)
        self.logprob_passes.record(result, training)
        logps = result.logps
        loss_pass = current_loss_pass()  # inside TRL's _compute_loss: the micro-batch, where its log-probs go too
        if loss_pass is not None:
            loss_pass.logps = logps.detach()
            self._deferred_correction(logps, loss_pass.batch)  # from the raw log-probs, before any seam
            logps = self._postprocess_loss_logps(logps, loss_pass.batch)
        return logps, result.entropies, result.aux_loss

    def _compute_loss(self, model, inputs):
        # TRL computes the loss pass's log-probs inside _compute_loss and forms the ratios inline; the batch is bound
        # for this call so that the pass's seams (_deferred_correction, _postprocess_loss_logps) see it.
        with loss_pass_of(inputs):
            return super()._compute_loss(model, inputs)

    def _postprocess_loss_logps(self, logps: torch.Tensor, inputs: dict) -> torch.Tensor:
        """Seam: the loss pass's per-token log-probs, before TRL turns them into importance ratios.

        GSPO-token: TRL's token branch computes `per_token_logps - old_per_token_logps` (pinned by a contract test);
        returning `old + w` makes that difference GSPO-token's log weight `w` (losses.log_importance_weights). The
        config allows this level only with loss_type="grpo", beta=0 and no off-policy mask, where the log-probs feed
        nothing but that difference.
        """
        if not self.uses_sequence_token_ratios:
            return logps
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        return old + log_importance_weights(logps, old, mask, "sequence_token")

    def _defers_old_logprobs(self) -> bool:
        """Seam: whether vLLM's importance-sampling correction comes from the loss pass instead of a separate
        old-policy pass in the rollout (``old_logprobs_from_loss_pass``). Valid when the loss pass runs with the weights that
        generated the batch: TRL's own alignment condition (it then takes the loss pass's detached log-probs as the
        old ones itself, without vLLM). PPO needs its old log-probs in the rollout (KL rewards) and overrides this."""
        if not (self.use_vllm and self.vllm_importance_sampling_correction):
            return False
        if not self.args.old_logprobs_from_loss_pass:
            return False
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every == 0

    def _deferred_correction(self, logps: torch.Tensor, inputs: dict) -> None:
        """Seam: vLLM's importance-sampling correction from the loss pass (``grpo.loss_pass_correction``)."""
        deferred_correction(self, logps, inputs)

    def _sequence_weight_normalisation(self) -> str:
        """Seam: how a sequence mode's correction weight combines its tokens (TRL's product here; the asynchronous
        trainer's ``sequence_behaviour_weight``)."""
        return "sum"

    def _generate_and_score_completions(self, inputs):
        """TRL's hook for a rollout: trlx_scale's collector (``rollout.collector``) builds the ``RolloutBatch``,
        the algorithm adds its quantities (``_finish_rollout``), and TRL's loss gets it as TRL's dict."""
        version = self.policy_version  # the engine serves it for this rollout (ensure_version)
        if self._rollout_has_images(inputs):
            batch = self._trl_rollout(inputs, version)
        elif self.dynamic_sampling is not None and self.model.training:
            batch = self.dynamic_sampling.collect(inputs, version)
        else:
            batch = RolloutCollector(self).collect(inputs, version)
        batch = self._finish_rollout(batch)
        # Then the samples are dealt to the ranks by cost where that leaves the loss unchanged (balance_ranks).
        return self.rank_balance.balance(batch.to_trl())

    def _build_dynamic_sampling(self) -> Any:
        """Seam: the component whose ``collect(rows, version)`` builds a training rollout of informative groups
        (here ``grpo.dynamic_sampling``; the asynchronous trainer's replaces groups in its producer)."""
        return DynamicSampling(self)

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

    def _rank_balance_algorithm_blocker(self) -> str | None:
        """Seam: an algorithm whose loss depends on which rank holds a sample refuses the move (PPO)."""
        return None

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
