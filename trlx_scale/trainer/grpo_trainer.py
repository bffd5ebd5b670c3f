"""``GRPOTrainer``: a drop-in subclass of ``trl.GRPOTrainer``.

Same constructor, same computation, while no trlx_scale option is on (the defaults that differ from TRL's, and why,
are listed in docs/defaults.md). The rollout path:

    engine (``generation.engine.RolloutEngine``: generate, at the trainer's policy version)
    -> ``rollout.RolloutBatch`` (TRL's rewards and advantages, then ``_finish_rollout``: PPO's values and GAE)
    -> log-prob pass (``passes``: padded or shared prefix, chosen once per run)
    -> TRL's loss (GSPO ratios from ``losses``; vLLM's correction from the loss pass)

Tool calling (``tools`` / ``environment_factory``): TRL's first turn, then each trajectory at its own pace on the
colocated engine (``ConcurrentToolLoopMixin``; ``tool_scheduling``).

The cross-cutting features (profiler, non-finite guard, policy version, atomic checkpoints, Hub push, planned
memory, fp32 masters) come from ``TrainerFeatures`` (``trainer/features.py``).
"""

from __future__ import annotations

import contextlib
import copy
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import send_to_device
from transformers.utils import logging
from trl import GRPOTrainer as TRLGRPOTrainer
from trl.trainer.utils import nanmax, nanmin

from ..agents.gym_rollout import GymRollout
from ..auto_switch import resolve_switch
from ..compat import old_logprob_pass
from ..generation.cpu_environment import configure_vllm_cpu_environment
from ..generation.engine import RolloutEngine, build_engine
from ..hub.secrets import check_tracker_uploads
from ..losses.policy_losses import log_importance_weights
from ..losses.vllm_importance_sampling import importance_sampling_statistics, vllm_importance_sampling_ratio
from ..optim.optimizer_offload import OptimizerStateOffloader
from ..options import option
from ..passes import LogProbPass, PackedPass, PaddedPass, PassRequest, PassResult, SharedPrefixPass
from ..passes.prefix_tree import PrefixTreePass, tree_is_cheaper
from ..passes.shared_prefix import all_ranks_can_share, unsupported_reason
from ..peft_models import is_peft_model
from ..reliability.checkpoints import checkpoint_world_size
from ..reliability.input_checks import GRPO_COLUMNS, check_dataset_columns, check_launch_matches, check_train_dataset
from ..reliability.reward_guard import guard_reward_functions, raise_reward_errors
from ..rollout.batch import RolloutBatch
from .concurrent_tool_loop_mixin import ConcurrentToolLoopMixin
from .features import TrainerFeatures
from .grpo_config import GRPOConfig
from .gym_rollout_mixin import GymRolloutMixin
from .padding_free_mixin import PaddingFreeMixin
from .rank_balance_mixin import RankBalanceMixin

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

logger = logging.get_logger(__name__)

ROLLOUT_STATE_NAME = "rollout_state_rank{}.pt"


class GRPOTrainer(
    GymRolloutMixin, ConcurrentToolLoopMixin, RankBalanceMixin, PaddingFreeMixin, TrainerFeatures, TRLGRPOTrainer
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
        self._loss_pass_inputs = None  # the micro-batch of the _compute_loss call in progress (see there)
        self._rollout_rewards = None  # the rewards of the _generate_and_score_completions call in progress
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
            reward_funcs = with_gym_reward_columns(reward_funcs, rollout_func, args)
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
            self._last_loaded_step = -1

    def _compute_loss(self, model, inputs):
        # TRL computes the loss pass's log-probs inside _compute_loss and forms the ratios inline; the batch rides
        # along so that _postprocess_loss_logps (the seam subclasses override) sees it.
        # The attribute lives for this call only (the pass runs inside it), so no TRL call order is assumed.
        self._loss_pass_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._loss_pass_inputs = None

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

    def _prepare_inputs(self, generation_batch):
        # TRL's rollout (generation, rewards, log-prob passes, advantages) runs here on generation steps; the parts
        # with a phase of their own are timed inside, the rest (decoding, gathers, advantages) is "rollout".
        with self.phase_timer.phase("rollout"):
            return super()._prepare_inputs(generation_batch)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        with self.phase_timer.phase("reward"):
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self._report_reward_errors()
        # TRL turns these into advantages inside _generate_and_score_completions and returns only those: they join
        # the RolloutBatch that call produces (the attribute lives for that call only).
        self._rollout_rewards = rewards_per_func
        return rewards_per_func

    def _report_reward_errors(self) -> None:
        """The guarded reward functions' failures as the same error on every rank (call it at the same point on
        each); in skip mode, the count of samples scored NaN as ``reliability/reward_errors``."""
        skipped = raise_reward_errors(self.reward_funcs, self.accelerator)
        if option(self.args, "reward_errors") == "skip":
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["reliability/reward_errors"].append(float(skipped))

    def _generate_and_score_completions(self, inputs):
        version = self.policy_version  # the engine serves it for this rollout (ensure_version)
        self._rollout_rewards = None
        self._rollout_rows = inputs  # a GymRollout's environments reset from them (gym_rollout_mixin)
        try:
            if self._defers_old_logprobs():
                # TRL's separate old-policy pass is skipped; the loss pass fills the correction (_deferred_correction).
                with old_logprob_pass.old_logprob_pass_skipped(self):
                    output = super()._generate_and_score_completions(inputs)
            else:
                output = super()._generate_and_score_completions(inputs)
            rewards_per_func = self._rollout_rewards
        finally:
            self._rollout_rewards = self._rollout_rows = None
        if rewards_per_func is None:
            raise RuntimeError("TRL's rollout returned without computing rewards (_calculate_rewards was not called).")
        batch = RolloutBatch.from_trl(
            output,
            rewards_per_func=rewards_per_func,
            policy_version=version,
            process_index=self.accelerator.process_index,
        )
        # Then the samples are dealt to the ranks by cost where that leaves the loss unchanged (balance_ranks).
        return self._balance_ranks(self._finish_rollout(batch).to_trl())

    def _defers_old_logprobs(self) -> bool:
        """Seam: whether vLLM's importance-sampling correction comes from the loss pass instead of TRL's separate
        old-policy pass (``old_logprobs_from_loss_pass``). Valid when the loss pass runs with the weights that
        generated the batch: TRL's own alignment condition (it then takes the loss pass's detached log-probs as the
        old ones itself, without vLLM). PPO needs its old log-probs in the rollout (KL rewards) and overrides this."""
        if not (self.use_vllm and self.vllm_importance_sampling_correction and old_logprob_pass.supported()):
            return False
        if not option(self.args, "old_logprobs_from_loss_pass"):
            return False
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every == 0

    def _deferred_correction(self, logps: torch.Tensor, inputs: dict) -> None:
        """vLLM's importance-sampling correction of a batch whose old-policy pass was skipped, from the loss pass's
        log-probs (detached: they are the old ones), put where TRL's loss reads it; and TRL's sampling/* metrics.
        A no-op for a batch that already has its correction (TRL's pass ran)."""
        if "importance_sampling_ratio" in inputs or "sampling_per_token_logps" not in inputs:
            return
        if not self._defers_old_logprobs():
            return
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        old, sampling = logps.detach(), inputs["sampling_per_token_logps"]
        mode = self.vllm_importance_sampling_mode
        ratio = vllm_importance_sampling_ratio(
            old,
            sampling,
            mask,
            mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
            self._sequence_weight_normalisation(),
        )
        inputs["importance_sampling_ratio"] = ratio
        stats = importance_sampling_statistics(old, sampling, ratio, mask, mode)
        # One gather (rows: ranks), then each statistic reduced across ranks as TRL reduces it.
        ranks = self.accelerator.gather(torch.stack(list(stats.values())).unsqueeze(0)).reshape(-1, len(stats))
        per_rank = dict(zip(stats, ranks.unbind(dim=1), strict=True))
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["sampling/sampling_logp_difference/mean"].append(per_rank["gap_mean"].mean().item())
        metrics["sampling/sampling_logp_difference/max"].append(per_rank["gap_max"].max().item())
        metrics["sampling/importance_sampling_ratio/min"].append(nanmin(per_rank["ratio_min"]).item())
        metrics["sampling/importance_sampling_ratio/mean"].append(per_rank["ratio_mean"].nanmean().item())
        metrics["sampling/importance_sampling_ratio/max"].append(nanmax(per_rank["ratio_max"]).item())

    def _sequence_weight_normalisation(self) -> str:
        """Seam: how a sequence mode's correction weight combines its tokens (TRL's product here; the asynchronous
        trainer's ``sequence_behaviour_weight``)."""
        return "sum"

    def _finish_rollout(self, batch: RolloutBatch) -> RolloutBatch:
        """Seam: an algorithm adds its own per-rollout quantities to the batch TRL scored (PPO: KL-penalized rewards,
        values, GAE advantages; the RLOO example of docs/contributing.md: leave-one-out advantages)."""
        return batch

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
        name = "ref_logprobs" if not training and self._is_reference_pass(model) else "old_logprobs"
        with self.phase_timer.phase(name) if not training else contextlib.nullcontext():
            result = self._choose_logprob_pass(model, request).run(model, request)
        self._record_pass(result, training)
        logps = result.logps
        if self._loss_pass_inputs is not None:
            self._deferred_correction(logps, self._loss_pass_inputs)  # from the raw log-probs, before any seam
            logps = self._postprocess_loss_logps(logps, self._loss_pass_inputs)
        return logps, result.entropies, result.aux_loss

    def _choose_logprob_pass(self, model, request: PassRequest) -> LogProbPass:
        """The pass for this batch: the run's choices (``padding_free``, ``shared_prefix``, each decided once at the
        first pass), except that a batch with a router loss or image inputs takes the padded pass (both cover the
        prompt tokens). With both on: the prefix-tree pass (each group's prompt once inside packed rows) where the
        attention takes a tree mask (sdpa, eager) and it costs fewer FLOPs on the batch (``tree_is_cheaper``), else
        the shared-prefix pass falling back to the packed one.

        Built per call, never kept on the trainer: a pass holds the trainer's bound methods, and a trainer -> pass ->
        trainer cycle would leave a finished trainer's engine to the cyclic garbage collector (see profiling's
        _StepClock)."""
        padded = PaddedPass(super()._get_per_token_logps_and_entropies)
        if request.has_extra_inputs:
            return padded
        rows = padded
        packing = self._padding_free_enabled(model)
        if packing:
            layout = dict(
                agree_max=self._agree_max,
                autocast=self.accelerator.autocast,
                max_tokens=option(self.args, "max_tokens_per_microbatch"),
                one_forward_with_grad=self._zero3_reentrant_checkpointing(model),
                coefficient=self._attention_cost_coefficient(),
                recompute=self._recompute_forwards(),
            )
            rows = PackedPass(padded, **layout)
        if not self._shared_prefix_enabled(model):
            return rows
        inner = self.accelerator.unwrap_model(model)
        if packing and PrefixTreePass.supports(inner):
            # The prefix tree (each group's prompt once, inside packed rows) where it costs fewer FLOPs than the
            # shared-prefix pass on this batch (tree_is_cheaper); every rank takes the same pass (collectives).
            cheaper = tree_is_cheaper(
                request.input_ids,
                request.attention_mask,
                request.logits_to_keep,
                inner.config,
                head_scores_every_position=self.accelerator.device.type != "cuda",
            )
            if self._agree_max(0 if cheaper else 1) == 0:
                return PrefixTreePass(rows, **layout)
        return SharedPrefixPass(
            rows,
            agree=self._all_ranks_can_share,
            autocast=self.accelerator.autocast,
            inner_model=self.accelerator.unwrap_model(model),
        )

    def _record_pass(self, result: PassResult, training: bool) -> None:
        """The profiler's count (from what the pass processed), the shared-prefix metric, and for the loss pass the
        layout's (``PaddingFreeMixin._record_layout``: ``batch/pad_frac`` and the others)."""
        self._count_logprob_pass(result.row_lengths, training=training, token_ratio=result.token_ratio)
        mode = "train" if self.model.training else "eval"
        if result.chunk_token_ratios:
            self._metrics[mode]["shared_prefix/token_ratio"].extend(result.chunk_token_ratios)
        if training:
            self._record_layout(result)

    def _is_reference_pass(self, model) -> bool:
        """The reference model, or a LoRA policy with its adapters off / its 'ref' adapter on (TRL's reference)."""
        if model is getattr(self, "ref_model", None):
            return True
        unwrapped = self.accelerator.unwrap_model(model)
        if not is_peft_model(unwrapped):
            return False
        if unwrapped.active_adapter == "ref":
            return True
        lora_layer = next((m for m in unwrapped.modules() if hasattr(m, "lora_A")), None)
        return bool(getattr(lora_layer, "disable_adapters", False))

    def _shared_prefix_enabled(self, model) -> bool:
        """Resolve `shared_prefix` once, at the first pass (gradient checkpointing is switched on by then)."""
        if getattr(self, "_shared_prefix_decision", None) is None:
            setting = option(self.args, "shared_prefix")
            self._shared_prefix_decision, self.shared_prefix_off_reason = resolve_switch(
                "shared_prefix", setting, lambda: self._shared_prefix_blocker(model, auto=setting == "auto")
            )
        return self._shared_prefix_decision

    def _shared_prefix_blocker(self, model, auto: bool) -> str | None:
        if getattr(self.args, "use_liger_kernel", False):
            return "use_liger_kernel computes the loss in a fused kernel from the full rows' hidden states"
        if self.is_fsdp_enabled and not self.accelerator.is_fsdp2:
            return (
                "FSDP1 is not verified with the shared pass (FSDP2 is): set fsdp_version: 2 in the Accelerate config"
            )
        if (
            self.is_deepspeed_enabled
            and self.accelerator.state.deepspeed_plugin.zero_stage == 3
            and self.args.gradient_checkpointing
            and is_peft_model(self.accelerator.unwrap_model(model))
        ):
            # TRL (GRPOTrainer.__init__) forces use_reentrant=True for PEFT under ZeRO-3 with checkpointing, because
            # DeepSpeed's partitioned frozen weights break the non-reentrant kind's recompute check
            # (deepspeedai/DeepSpeed#4332); reentrant checkpointing cuts the gradient of the shared states.
            return (
                "TRL forces reentrant gradient checkpointing for a PEFT model under DeepSpeed ZeRO-3, and reentrant "
                "checkpointing cuts the gradient of the shared states; set gradient_checkpointing=False (or train "
                "all weights) to use it under ZeRO-3"
            )
        if auto and self.num_generations == 1:
            return "num_generations=1, so no prompt is repeated in a batch"
        return unsupported_reason(self.accelerator.unwrap_model(model))

    def _all_ranks_can_share(self, local: bool) -> bool:
        """The per-chunk decision, agreed by all ranks when parameters are sharded (``all_ranks_can_share``)."""
        sharded = self.is_deepspeed_enabled or self.is_fsdp_enabled
        return all_ranks_can_share(local, sharded, device=self.accelerator.device)

    def _check_vllm_only_options(self) -> None:
        """The checks TRL's __init__ runs only when use_vllm is on (it saw it off); kept in step by a contract test."""
        if self.loss_type == "vespo" and self.vllm_importance_sampling_correction:
            if self.vllm_importance_sampling_mode not in ["token_truncate", "token_mask"]:
                raise ValueError(
                    f"VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or "
                    f"'token_mask'. Got: {self.vllm_importance_sampling_mode}."
                )

    def _build_colocated_engine(self) -> RolloutEngine:
        """The colocated engine, configured from TRL's GRPO fields as TRL configures its own, plus trlx_scale's."""
        args = self.args
        return build_engine(
            args,
            model=self.model,
            accelerator=self.accelerator,
            processing_class=self.processing_class,
            policy_version=_policy_version_of(self),
            phase_timer=self.phase_timer,  # its weight syncs are their own phase
            structured_outputs_regex=args.vllm_structured_outputs_regex,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_length=args.vllm_max_model_length,
            max_num_seqs=args.per_device_train_batch_size * args.vllm_tensor_parallel_size * args.steps_per_generation,
            enable_sleep_mode=args.vllm_enable_sleep_mode,
            model_impl=args.vllm_model_impl,
            trust_remote_code=args.trust_remote_code,
            repetition_penalty=self.repetition_penalty,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            max_completion_length=self.max_completion_length,
            logprobs=0,  # only the sampled tokens' log-probs (importance-sampling correction)
            generation_kwargs=args.generation_kwargs,
        )

    # ------------------------------------------------------------------ checkpoints: the rollout in progress

    def _save_extra_state(self, checkpoint_dir: str) -> None:
        """TRL restarts its micro-step counter at 0 and drops the rollout buffer on resume: a checkpoint taken in the
        middle of a rollout's mini-batches (steps_per_generation or num_iterations > 1) would then regenerate early
        and shift every later rollout. Each rank saves both (its buffer is its own)."""
        super()._save_extra_state(checkpoint_dir)
        state = {"step": self._step, "buffered_inputs": send_to_device(self._buffered_inputs, "cpu")}
        torch.save(state, os.path.join(checkpoint_dir, ROLLOUT_STATE_NAME.format(self.accelerator.process_index)))

    def _load_extra_state(self, checkpoint_dir: str) -> None:
        super()._load_extra_state(checkpoint_dir)
        saved = checkpoint_world_size(checkpoint_dir)
        if saved is not None and saved != self.accelerator.num_processes:
            # Each rank's buffer holds its share of the rollout: at another world size the shares do not map.
            logger.warning(
                "%s was saved by %d processes, this run has %d: the rollout in progress is generated afresh.",
                checkpoint_dir,
                saved,
                self.accelerator.num_processes,
            )
            return
        path = os.path.join(checkpoint_dir, ROLLOUT_STATE_NAME.format(self.accelerator.process_index))
        if not os.path.isfile(path):
            logger.warning("%s is missing: the first rollout after resuming is generated afresh.", path)
            return
        state = torch.load(path, map_location="cpu", weights_only=False)  # our own file: tensors and lists
        self._step = int(state["step"])
        self._buffered_inputs = send_to_device(state["buffered_inputs"], self.accelerator.device)

    def _planner_extra_roles(self) -> dict:
        return {"reference": self.beta != 0.0}  # TRL builds a reference model only for a KL term

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        with self.phase_timer.phase("generation"):  # optimizer offload, wake, (sync), generate, sleep, reload
            offloader = None
            if option(self.args, "offload_optimizer_during_generation") and self.optimizer is not None:
                offloader = OptimizerStateOffloader(self.optimizer)
                offloaded = offloader.offload()
            engine = self._rollout_engine()
            if engine is not None:
                mode = "train" if self.model.training else "eval"
                engine.set_rollout_seed(self.args.seed, self.state.global_step, mode)
            try:
                result = super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images
                )
            finally:
                if offloader is not None:
                    offloader.reload()  # before the loss and the optimizer step
        self._count_generation(prompt_ids, result[0])  # TRL returns (completion_ids, logprobs)
        mode = "train" if self.model.training else "eval"
        if offloader is not None:
            self._metrics[mode]["memory/optimizer_offloaded_gib"].append(offloaded / 2**30)
        if engine is not None:
            for name, value in engine.pop_metrics().items():
                self._metrics[mode][name].append(value)
        return result

    def _rollout_engine(self) -> RolloutEngine | None:
        """trlx_scale's engine, when this run generates with it (not with TRL's transformers path or server)."""
        engine = getattr(self, "vllm_generation", None)
        return engine if isinstance(engine, RolloutEngine) else None

    def _policy_engine(self) -> RolloutEngine | None:
        return self._rollout_engine()

    def _before_log(self) -> None:
        # The gap between vLLM's and the trainer's log-probs of the sampled tokens, right after a sync: TRL measures
        # it (as the importance-sampling diagnostic) whenever it computes the trainer's log-probs; it is exposed
        # under sync/ as the staleness check. Numerical noise when the engine is in sync; large when it is stale.
        mode = "train" if self.model.training else "eval"
        for source, target in (
            ("sampling/sampling_logp_difference/mean", "sync/logprob_gap_mean"),
            ("sampling/sampling_logp_difference/max", "sync/logprob_gap_max"),
        ):
            if self._metrics[mode].get(source):
                self._metrics[mode][target] = list(self._metrics[mode][source])


def with_gym_reward_columns(reward_funcs: Any, gym: GymRollout, args: Any) -> list:
    """The user's reward functions followed by a ``GymRollout``'s reward columns (agents/gym_rollout.py)."""
    user = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs]
    columns = gym.reward_functions()
    weights = getattr(args, "reward_weights", None)
    if weights is not None and len(weights) != len(user) + len(columns):
        names = ", ".join(function.__name__ for function in columns)
        raise ValueError(
            f"reward_weights has {len(weights)} entries; with rollout_func=GymRollout(...) the reward columns are "
            f"the {len(user)} reward_funcs followed by the environment's ({names}): give {len(user) + len(columns)} "
            "weights in that order."
        )
    return user + columns


def _policy_version_of(trainer: GRPOTrainer) -> Callable[[], int]:
    """The engine's view of the trainer's policy version, holding the trainer weakly (no trainer <-> engine cycle:
    see profiling's _StepClock)."""
    ref = weakref.ref(trainer)

    def current() -> int:
        return ref().policy_version

    return current
