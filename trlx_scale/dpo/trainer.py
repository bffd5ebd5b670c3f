"""``DPOTrainer``: a drop-in subclass of ``trl.DPOTrainer``.

Same constructor (plus an optional ``reward_funcs`` for online DPO), same behaviour while no trlx_scale option is on.
What it adds:

- the features of every trlx_scale trainer (``TrainerFeatures``: profiler, non-finite guard, policy version, atomic
  checkpoints, Hub push, planned memory, ``optim_preset`` / ``fp32_master_weights``);
- the reference of a LoRA policy is the base with the adapter disabled, so no second model is loaded (TRL's own
  behaviour when ``ref_model`` is None; kept and tested);
- ``vllm_ref_log_probs``: reference log-probs of the whole dataset computed once by the colocated vLLM engine
  (``prompt_logprobs``) in place of TRL's ``precompute_ref_log_probs`` forward passes;
- ``online``: each step, the current policy samples completions for the batch's prompts through the colocated engine
  (LoRA-only sync, sleep/wake), ``reward_funcs`` rank them, and DPO trains on the (best, worst) pairs.

Where the parts live: the engine and the reference log-probs it scores in ``dpo.reference_engine`` (built and called
here), the online rounds in ``dpo.online`` (``OnlineDPO``); this file holds the constructor, the loss (packed rows) and the checkpoint's token count.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import trl
from datasets import Dataset, IterableDataset
from transformers.utils import logging
from trl import DPOTrainer as TRLDPOTrainer
from trl.trainer.dpo_trainer import DataCollatorForPreference

from ..atomic_files import write_text_atomically
from ..compat import trl_trainer_state as trl_state
from ..compat.trl_init_config import config_for_trl_init
from ..generation.cpu_environment import configure_vllm_cpu_environment
from ..generation.engine import RolloutEngine
from ..hub.secrets import check_tracker_uploads
from ..passes.logprob_pass import PassResult
from ..passes.packed_model_call import PackedModelCall
from ..passes.packed_rows import PackedRows
from ..reliability.input_checks import (
    DPO_COLUMNS,
    ONLINE_DPO_COLUMNS,
    check_dataset_columns,
    check_launch_matches,
    check_train_dataset,
)
from ..reliability.reward_guard import guard_reward_functions
from ..rollout.collector import RolloutSamples
from ..trainer_features import TrainerFeatures
from ..trainer_part import TrainerPart
from ..trl_config_upgrade import trainer_config
from .config import DPOConfig
from .online import OnlineDPO, keep_examples
from .online_pair_balance import check_multi_process_online_loss
from .reference_engine import build_dpo_engine, vllm_reference_logps

if TYPE_CHECKING:
    from datasets import DatasetDict, IterableDatasetDict
    from peft import PeftConfig, PeftModel
    from transformers import (
        BitsAndBytesConfig,
        EvalPrediction,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        ProcessorMixin,
        TrainerCallback,
    )
    from transformers.data.data_collator import DataCollator

logger = logging.get_logger(__name__)


class DPOTrainer(TrainerFeatures, TRLDPOTrainer):
    """Direct Preference Optimization, as [`trl.DPOTrainer`], with trlx_scale's options.

    The constructor takes TRL's arguments in TRL's order (a contract test compares the signatures) and one more,
    `reward_funcs` (GRPO's reward-function signature), used only by `online=True`. `args` may be a
    [`trlx_scale.DPOConfig`] or a plain [`trl.DPOConfig`].
    """

    _tag_names = ["trl", "dpo", "trlx-scale"]

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        ref_model: PreTrainedModel | None = None,
        args: DPOConfig | None = None,
        data_collator: DataCollator | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset
        | IterableDataset
        | DatasetDict
        | IterableDatasetDict
        | dict[str, Dataset | IterableDataset]
        | None = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        compute_metrics: Callable[[EvalPrediction], dict] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        quantization_config: BitsAndBytesConfig | None = None,
        peft_config: PeftConfig | None = None,
        reward_funcs: Callable | list[Callable] | None = None,
    ):
        # A plain trl.DPOConfig (or None) becomes ours, every trlx_scale field at what a plain TRL config means.
        args = trainer_config(args, model, DPOConfig, trl.DPOConfig, "DPO")
        check_train_dataset(train_dataset)
        check_launch_matches(args)
        check_tracker_uploads(args)
        self._online = args.online
        needs = ONLINE_DPO_COLUMNS if self._online else DPO_COLUMNS
        check_dataset_columns(train_dataset, needs, type(self).__name__ + (" (online)" if self._online else ""))
        check_dataset_columns(eval_dataset, DPO_COLUMNS, type(self).__name__, "eval_dataset")
        self._vllm_ref = args.vllm_ref_log_probs
        self._engine: RolloutEngine | None = None  # built on first use (TRL's __init__ may need it)
        # Online DPO's rounds (TRL's __init__ prepares the dataset through it already).
        self.online = OnlineDPO(self)
        reward_funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs or [])
        if self._online and not reward_funcs:
            raise ValueError("online=True ranks sampled completions with reward_funcs: pass reward_funcs=[...].")
        if self._online and eval_dataset is not None:
            raise ValueError(
                "online=True trains on pairs sampled each step and has no preference pairs to evaluate; drop "
                "eval_dataset and measure the policy by generation (as examples/dpo.py does)."
            )
        if reward_funcs and not self._online:
            raise ValueError("reward_funcs is used by online DPO only: set online=True in DPOConfig or drop them.")
        self.reward_funcs = guard_reward_functions(reward_funcs, args.reward_errors)
        if args.uses_engine:
            configure_vllm_cpu_environment(args.vllm_cpu_kvcache_space)
        padding_free = args.padding_free
        # TRL 1.16 reads its own padding_free in __init__ and warns that it is disabled: TRL's copy says False; ours
        # is read through self.args later (the passes pack the rows themselves).
        switched = {"padding_free": False}
        if self._online:
            # Prompt-only rows reach training_step untouched (the reward functions read their extra columns).
            switched["remove_unused_columns"] = False
            data_collator = data_collator or keep_examples
        args = config_for_trl_init(args, **switched)
        super().__init__(
            model=model,
            ref_model=ref_model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self.checkpoint_parts.register("dpo_token_count", DPOTokenCountPart(self))
        self.args.padding_free = padding_free  # our copy (see above): trlx_scale's setting from here on
        if self._online and self.accelerator.num_processes > 1:
            check_multi_process_online_loss(list(self.loss_types), bool(args.use_weighting))
        if self._online:
            self._pair_collator = DataCollatorForPreference(
                pad_token_id=trl_state.tokenizer(self).pad_token_id,
                max_length=args.max_length,
                truncation_mode=args.truncation_mode,
                pad_to_multiple_of=args.pad_to_multiple_of,
            )

    # ---------------------------------------------------------------- online rounds (dpo.online)
    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if not self._online:
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        return self.online.prepare_dataset(dataset, dataset_name)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None):
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)
        finally:
            self.online.close()

    def _training_step(self, model, inputs, num_items_in_batch=None):
        if not self._online:
            return super()._training_step(model, inputs, num_items_in_batch)
        return self.online.training_step(super()._training_step, model, inputs, num_items_in_batch)

    def _rollout_prompts(self, rows: list[dict[str, Any]]) -> list:
        """The collector's prompt stage: the rows' prompts as they are."""
        return [row["prompt"] for row in rows]

    def _sample_rollout(self, prompts: list, rows: list[dict[str, Any]]) -> RolloutSamples:
        return self.online.sample(prompts, rows)

    def _rollout_rewards(self, rows: list[dict[str, Any]], prompts: list, samples: RolloutSamples) -> torch.Tensor:
        return self.online.rewards(rows, prompts, samples)

    # ---------------------------------------------------------------- the engine (reference scoring, online rounds)
    def _colocated_engine(self) -> RolloutEngine:
        if self._engine is None:
            self._engine = build_dpo_engine(self)
        return self._engine

    def _policy_engine(self) -> RolloutEngine | None:
        return self._engine

    # What the memory planner needs to know of this run (trlx_scale.planning.trainer_memory).
    def _planner_algorithm(self) -> str:
        return "online-dpo" if self._online else "dpo"

    def _planner_engine(self):
        return self._engine

    def _planner_num_generations(self) -> int:
        return self.args.online_num_generations if self._online else 2

    def _planner_extra_roles(self) -> dict:
        return {"reference": self.ref_model is not None}

    def _precompute_ref_logps(self, dataset: Dataset, name: str, batch_size: int) -> Dataset:
        # Once, before training: logged as time/ref_scoring with the first step's metrics.
        with self.phase_timer.phase("ref_scoring", absorb=True):
            if not self._vllm_ref:
                return super()._precompute_ref_logps(dataset, name, batch_size)
            return vllm_reference_logps(self, dataset, name)

    def _compute_loss(self, model, inputs, return_outputs):
        training = torch.is_grad_enabled()
        if training:  # a training pass: the policy's forward+backward, the reference's forward
            # Each row's real tokens (the profiler counts what a pass must cover, whatever its layout).
            row_lengths = inputs["attention_mask"].sum(dim=-1)
            self.profiler.count_logprob_pass(row_lengths, training=True)
            if not self.precompute_ref_logps:
                self.profiler.count_logprob_pass(row_lengths, training=False)
        if self.pass_layout.padding_free_enabled(model) and "input_ids" in inputs:
            # TRL's policy forward over the chosen and rejected rows runs on packed rows (passes.packed_model_call).
            model = PackedModelCall(
                model,
                agree_max=self.pass_layout.agree_max,
                max_tokens=self.args.max_tokens_per_microbatch,
                on_pass=self._record_packed_rows if training else None,
                coefficient=self.pass_layout.attention_cost_coefficient(),
                recompute=self.pass_layout.recompute_forwards(),
            )
        elif training and "input_ids" in inputs:
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
            padded = PassResult(
                None,
                None,
                None,
                mask.sum(dim=-1),
                processed_tokens=float(ids.numel()),
                padding_tokens=float(ids.numel() - mask.sum()),
                row_tokens=ids.size(1),
            )
            self.pass_layout.record_layout(padded)
        result = super()._compute_loss(model, inputs, return_outputs)
        scale = self.online.loss_scale
        if scale == 1.0:
            return result
        offset = self.online.loss_offset  # the tie pairs' constant: no gradient, not logged
        if return_outputs:
            return result[0] * scale - offset, result[1]
        return result * scale - offset

    def _record_packed_rows(self, rows: PackedRows, recomputed_forwards: int) -> None:
        self.pass_layout.record_layout(
            PassResult(
                None,
                None,
                None,
                rows.lengths,
                processed_tokens=float(rows.processed_tokens),
                padding_tokens=float(rows.processed_tokens - rows.real_tokens),
                forwards=len(rows.forwards),
                oversize_samples=rows.oversize,
                row_tokens=rows.row_tokens,
                recomputed_forwards=recomputed_forwards,
            )
        )


DPO_STATE_NAME = "dpo_state.json"


class DPOTokenCountPart(TrainerPart):
    """``DPOTrainer``'s checkpoint part (``reliability.checkpoint_parts``): TRL counts the trained tokens (the logged
    ``num_tokens``) in an attribute no checkpoint holds."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)

    def save(self, checkpoint_dir: str) -> None:
        trainer = self.trainer
        if trainer.args.should_save:
            write_text_atomically(
                os.path.join(checkpoint_dir, DPO_STATE_NAME),
                json.dumps({"total_train_tokens": trl_state.total_train_tokens(trainer)}),
            )

    def load(self, checkpoint_dir: str) -> None:
        path = os.path.join(checkpoint_dir, DPO_STATE_NAME)
        if os.path.isfile(path):
            with open(path) as handle:
                trl_state.set_total_train_tokens(self.trainer, json.load(handle)["total_train_tokens"])
