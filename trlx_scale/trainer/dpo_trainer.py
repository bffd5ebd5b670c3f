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
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather_object
from datasets import Dataset, IterableDataset
from tqdm.auto import tqdm
from transformers.utils import logging
from trl import DPOTrainer as TRLDPOTrainer
from trl.data_utils import is_conversational
from trl.trainer.dpo_trainer import DataCollatorForPreference

from ..atomic_files import write_text_atomically
from ..compat.vllm_cpu_lora_scoring import scoring_sync_mode
from ..dpo.online_pair_balance import balance_pairs, check_multi_process_online_loss, tie_pair_loss
from ..dpo.preference_pairs import best_worst_pairs, completion_logprob_sums
from ..generation.cpu_environment import configure_vllm_cpu_environment, running_on_cpu_only
from ..generation.engine import RolloutEngine, build_engine
from ..hub.secrets import check_tracker_uploads
from ..options import option
from ..passes.logprob_pass import PassResult
from ..passes.packed_model_call import PackedModelCall
from ..passes.packed_rows import PackedRows
from ..peft_models import is_peft_model
from ..reliability.input_checks import (
    DPO_COLUMNS,
    ONLINE_DPO_COLUMNS,
    check_dataset_columns,
    check_launch_matches,
    check_train_dataset,
)
from ..reliability.reward_guard import guard_reward_functions, raise_reward_errors
from .colocated_engine_mixin import policy_version_of
from .dpo_config import DPOConfig
from .features import TrainerFeatures
from .padding_free_mixin import PaddingFreeMixin

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

# Examples sent to the engine at a time when it scores reference log-probs (vLLM batches them internally).
REF_SCORING_CHUNK = 512


class DPOTrainer(PaddingFreeMixin, TrainerFeatures, TRLDPOTrainer):
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
        check_train_dataset(train_dataset)
        if args is not None:
            check_launch_matches(args)
            check_tracker_uploads(args)
        self._online = option(args, "online")
        needs = ONLINE_DPO_COLUMNS if self._online else DPO_COLUMNS
        check_dataset_columns(train_dataset, needs, type(self).__name__ + (" (online)" if self._online else ""))
        check_dataset_columns(eval_dataset, DPO_COLUMNS, type(self).__name__, "eval_dataset")
        self._vllm_ref = option(args, "vllm_ref_log_probs")
        self._engine: RolloutEngine | None = None  # built on first use (TRL's __init__ may need it)
        # Online DPO's loss rescaling of the micro-batch in progress (set and reset around it: _training_step).
        self._online_loss_scale, self._online_loss_offset = 1.0, 0.0
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
        self.reward_funcs = guard_reward_functions(reward_funcs, option(args, "reward_errors"))
        if option(args, "uses_engine"):
            configure_vllm_cpu_environment(args.vllm_cpu_kvcache_space)
        padding_free = option(args, "padding_free")
        if args is not None and hasattr(args, "padding_free"):
            # TRL 1.16 reads its own padding_free (a bool) in __init__ and warns that it is disabled: TRL is handed a
            # copy that says False (the caller's object is never changed); ours is read through self.args later.
            args = copy.copy(args)
            args.padding_free = False
        if self._online:
            # Prompt-only rows reach training_step untouched (the reward functions read their extra columns); set
            # on a copy, never on the caller's config.
            args = copy.copy(args)
            args.remove_unused_columns = False
            data_collator = data_collator or _keep_examples
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
        if isinstance(padding_free, str):
            self.args.padding_free = padding_free  # our copy (see above): trlx_scale's setting from here on
        if self._online and self.accelerator.num_processes > 1:
            check_multi_process_online_loss(list(self.loss_types), bool(args.use_weighting))
        if self._online:
            self._pair_collator = DataCollatorForPreference(
                pad_token_id=self._tokenizer.pad_token_id,
                max_length=args.max_length,
                truncation_mode=args.truncation_mode,
                pad_to_multiple_of=args.pad_to_multiple_of,
            )

    # ------------------------------------------------------------------ engine

    def _colocated_engine(self) -> RolloutEngine:
        if self._engine is None:
            args = self.args
            # Sequences longer than the model's positions are truncated by max_length already; the engine may not
            # be configured beyond the model's own limit.
            limit = getattr(self.accelerator.unwrap_model(self.model).config, "max_position_embeddings", None)
            max_model_length = args.vllm_max_model_length or args.max_length
            if limit is not None and max_model_length is not None:
                max_model_length = min(max_model_length, limit)
            per_step = args.per_device_train_batch_size * args.online_num_generations
            max_num_seqs = per_step if self._online else 256
            self._engine = build_engine(
                args,
                model=self.model,
                accelerator=self.accelerator,
                processing_class=self.processing_class,
                policy_version=policy_version_of(self),
                phase_timer=self.phase_timer,  # its weight syncs are their own phase
                gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                max_model_length=max_model_length,
                max_num_seqs=max_num_seqs,
                enable_sleep_mode=args.vllm_enable_sleep_mode,
                trust_remote_code=args.trust_remote_code,
                temperature=args.online_temperature,
                max_completion_length=args.online_max_completion_length,
                logprobs=0,
                # Reference scoring needs prompt_logprobs, which a LoRA-enabled engine cannot do on every stack
                # (compat/vllm_cpu_lora_scoring.py); online rounds sample, and keep LoRA-only sync.
                sync_mode=args.vllm_sync_mode
                if self._online
                else scoring_sync_mode(args.vllm_sync_mode, running_on_cpu_only()),
            )
        return self._engine

    def _policy_engine(self) -> RolloutEngine | None:
        return self._engine

    # ------------------------------------------------------------------ reference log-probs from vLLM

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
            return self._reference_scoring(dataset, name, batch_size)

    def _reference_scoring(self, dataset: Dataset, name: str, batch_size: int) -> Dataset:
        if not self._vllm_ref:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        if isinstance(dataset, IterableDataset):
            raise ValueError("vllm_ref_log_probs needs a map-style Dataset (it scores every example once).")
        if self.ref_model is not None:
            raise ValueError(
                "vllm_ref_log_probs scores the reference with the engine, which holds the policy's initial weights; "
                "an explicit ref_model is not supported there. Pass ref_model=None (the reference is then the "
                "initial policy, or the base of a LoRA policy) or set vllm_ref_log_probs=False."
            )
        unwrapped = self.accelerator.unwrap_model(self.model)
        if is_peft_model(unwrapped) and "ref" in unwrapped.peft_config:
            raise ValueError(
                "vllm_ref_log_probs scores the base model, but this PEFT model carries a 'ref' adapter as its "
                "reference; set vllm_ref_log_probs=False to use TRL's reference pass."
            )
        engine = self._colocated_engine()
        engine.ensure_version(self.policy_version)  # the trainer's weights as they are before any update
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        mine = list(range(rank, len(dataset), world))
        chosen, rejected = [], []
        start = time.perf_counter()
        offsets = tqdm(
            range(0, len(mine), REF_SCORING_CHUNK),
            desc=f"vLLM reference log-probs ({name})",
            unit="chunk",
            disable=not self.accelerator.is_main_process or bool(self.args.disable_tqdm),
        )
        for offset in offsets:
            rows = [dataset[i] for i in mine[offset : offset + REF_SCORING_CHUNK]]
            batch = self.data_collator(rows)  # TRL's collator: its truncation, its completion mask
            sums = completion_logprob_sums(
                engine, batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
            )
            chosen += sums[: len(rows)]
            rejected += sums[len(rows) :]
        local = list(zip(mine, chosen, rejected, strict=True))
        gathered = [local] if world == 1 else _all_gather_objects(local, world)
        by_index = {i: (c, r) for part in gathered for i, c, r in part}
        logger.info(
            "vLLM reference log-probs of %d %s examples in %.1f s", len(dataset), name, time.perf_counter() - start
        )
        dataset = dataset.add_column("ref_chosen_logps", [by_index[i][0] for i in range(len(dataset))])
        return dataset.add_column("ref_rejected_logps", [by_index[i][1] for i in range(len(dataset))])

    # ------------------------------------------------------------------ online DPO

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if not self._online:
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        first = next(iter(dataset))
        if "prompt" not in first:
            raise ValueError(
                f"online=True needs a 'prompt' column in the {dataset_name} dataset; it has {list(first)}."
            )
        tokenizer = self._tokenizer

        def tokenize(example):
            if is_conversational(example):
                ids = tokenizer.apply_chat_template(example["prompt"], add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]
            return {"prompt_ids": list(ids)}

        return dataset.map(tokenize, desc=f"Tokenizing {dataset_name} prompts")

    def _training_step(self, model, inputs, num_items_in_batch=None):
        # Inside TrainerFeatures.training_step: profiled and guarded on every path, the batch without pairs included.
        if not self._online:
            return super()._training_step(model, inputs, num_items_in_batch)
        pairs = self._online_round(inputs)
        if self.accelerator.num_processes > 1:
            # Equal numbers of pairs on every rank (TRL's loss gathers per-pair tensors); the loss is rescaled so
            # the gradient stays the mean over the step's real pairs (dpo/online_pair_balance.py).
            balanced = balance_pairs(
                gather_object(pairs), self.accelerator.process_index, self.accelerator.num_processes
            )
            pairs, self._online_loss_scale = balanced.pairs, balanced.loss_scale
            world = self.accelerator.num_processes
            tie = tie_pair_loss(list(self.loss_types), self.loss_weights, self.beta)
            self._online_loss_offset = world * balanced.padding * tie / max(balanced.total, 1)
            self._metrics["train"]["online/padding_pairs"].append(float(balanced.total_padding))
        if not pairs:
            # Every prompt's samples scored the same: no preference to learn. A zero loss still runs backward, so
            # data-parallel ranks stay in step.
            model.train()
            loss = sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
            self.accelerator.backward(loss)
            return loss.detach()
        try:
            return super()._training_step(model, self._pair_collator(pairs), num_items_in_batch)
        finally:
            self._online_loss_scale, self._online_loss_offset = 1.0, 0.0

    def _compute_loss(self, model, inputs, return_outputs):
        training = torch.is_grad_enabled()
        if training:  # a training pass: the policy's forward+backward, the reference's forward
            # Each row's real tokens (the profiler counts what a pass must cover, whatever its layout).
            row_lengths = inputs["attention_mask"].sum(dim=-1)
            self._count_logprob_pass(row_lengths, training=True)
            if not self.precompute_ref_logps:
                self._count_logprob_pass(row_lengths, training=False)
        if self._padding_free_enabled(model) and "input_ids" in inputs:
            # TRL's policy forward over the chosen and rejected rows runs on packed rows (passes.packed_model_call).
            model = PackedModelCall(
                model,
                agree_max=self._agree_max,
                max_tokens=option(self.args, "max_tokens_per_microbatch"),
                on_pass=self._record_packed_rows if training else None,
                coefficient=self._attention_cost_coefficient(),
                recompute=self._recompute_forwards(),
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
            self._record_layout(padded)
        result = super()._compute_loss(model, inputs, return_outputs)
        scale = self._online_loss_scale
        if scale == 1.0:
            return result
        offset = self._online_loss_offset  # the tie pairs' constant: no gradient, not logged
        if return_outputs:
            return result[0] * scale - offset, result[1]
        return result * scale - offset

    def _record_packed_rows(self, rows: PackedRows, recomputed_forwards: int) -> None:
        self._record_layout(
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

    def _save_extra_state(self, checkpoint_dir: str) -> None:
        # TRL counts the trained tokens (the logged num_tokens) in an attribute no checkpoint holds.
        super()._save_extra_state(checkpoint_dir)
        if self.args.should_save:
            write_text_atomically(
                os.path.join(checkpoint_dir, DPO_STATE_NAME),
                json.dumps({"total_train_tokens": self._total_train_tokens}),
            )

    def _load_extra_state(self, checkpoint_dir: str) -> None:
        super()._load_extra_state(checkpoint_dir)
        path = os.path.join(checkpoint_dir, DPO_STATE_NAME)
        if os.path.isfile(path):
            with open(path) as handle:
                self._total_train_tokens = json.load(handle)["total_train_tokens"]

    def _global_round_stats(self, stats: dict[str, float], pairs: int) -> dict[str, float]:
        """The round's statistics over every rank (each rank has as many prompts and samples as the others): means
        of the rank means, and the reward gap averaged over all pairs."""
        if self.accelerator.num_processes == 1:
            return stats
        local = torch.tensor(
            [stats["reward_mean"], stats["pair_fraction"], stats["reward_gap"] * pairs, float(pairs)],
            device=self.accelerator.device,
        )
        reward_mean, pair_fraction, gap_sum, total = self.accelerator.reduce(local, reduction="sum").tolist()
        world = self.accelerator.num_processes
        return {
            "reward_mean": reward_mean / world,
            "pair_fraction": pair_fraction / world,
            "reward_gap": gap_sum / total if total else 0.0,
        }

    def _online_round(self, examples: list[dict[str, Any]]) -> list[dict[str, list[int]]]:
        """Sample, score and pair one batch of prompts with the current policy."""
        args = self.args
        engine = self._colocated_engine()  # it serves the current policy version (LoRA-only sync where possible)
        group = args.online_num_generations
        prompt_ids = [example["prompt_ids"] for example in examples]
        repeated = [ids for ids in prompt_ids for _ in range(group)]
        engine.set_rollout_seed(self.args.seed, self.state.global_step)
        with self.phase_timer.phase("generation"):
            _, completion_ids, _, _ = engine.generate(prompts=repeated, images=None, num_generations=group)
        self._count_generation(repeated, completion_ids)
        texts = self._tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        conversational = is_conversational(examples[0])
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        prompts = [example["prompt"] for example in examples for _ in range(group)]
        columns = {
            key: [example[key] for example in examples for _ in range(group)]
            for key in examples[0]
            if key not in ("prompt", "prompt_ids")
        }
        rewards = torch.zeros(len(repeated))
        with self.phase_timer.phase("reward"):
            for func in self.reward_funcs:
                values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
                rewards += torch.tensor([float("nan") if v is None else v for v in values])
            skipped = raise_reward_errors(self.reward_funcs, self.accelerator)
        if skipped or self.args.reward_errors == "skip":
            self._metrics["train"]["reliability/reward_errors"].append(float(skipped))
        pairs, stats = best_worst_pairs(prompt_ids, completion_ids, rewards.view(len(examples), group))
        stats = self._global_round_stats(stats, len(pairs))
        mode = "train"
        for key, value in {**stats, **engine.pop_metrics()}.items():
            self._metrics[mode][key if "/" in key else f"online/{key}"].append(value)
        return pairs


DPO_STATE_NAME = "dpo_state.json"


def _keep_examples(examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Online DPO's collator: the rows go to the online round as they are."""
    return examples


def _all_gather_objects(local: list, world: int) -> list[list]:
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, local)
    return gathered
