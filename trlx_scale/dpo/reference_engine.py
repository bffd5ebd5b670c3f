"""``DPOEngineMixin``: ``DPOTrainer``'s colocated vLLM engine, and the reference log-probs it scores.

One engine serves both uses of it: ``vllm_ref_log_probs`` (the reference log-probs of the whole dataset computed
once with ``prompt_logprobs``, in place of TRL's ``precompute_ref_log_probs`` forward passes) and ``online`` rounds
(``OnlineDPOMixin``). Built on first use, at the trainer's policy version; the memory planner reads its size here.
"""

from __future__ import annotations

import time

import torch
from datasets import Dataset, IterableDataset
from tqdm.auto import tqdm
from transformers.utils import logging

from ..compat.vllm_cpu_lora_scoring import scoring_sync_mode
from ..generation.colocated_engine_setup import policy_version_of
from ..generation.cpu_environment import running_on_cpu_only
from ..generation.engine import RolloutEngine, build_engine
from ..peft_models import is_peft_model
from .preference_pairs import completion_logprob_sums

logger = logging.get_logger(__name__)

# Examples sent to the engine at a time when it scores reference log-probs (vLLM batches them internally).
REF_SCORING_CHUNK = 512


class DPOEngineMixin:
    """Part of ``DPOTrainer`` (see the module docstring); placed before TRL's class in its bases."""

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
        gathered = [local] if world == 1 else all_gather_objects(local, world)
        by_index = {i: (c, r) for part in gathered for i, c, r in part}
        logger.info(
            "vLLM reference log-probs of %d %s examples in %.1f s", len(dataset), name, time.perf_counter() - start
        )
        dataset = dataset.add_column("ref_chosen_logps", [by_index[i][0] for i in range(len(dataset))])
        return dataset.add_column("ref_rejected_logps", [by_index[i][1] for i in range(len(dataset))])


def all_gather_objects(local: list, world: int) -> list[list]:
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, local)
    return gathered
