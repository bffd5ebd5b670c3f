"""``DPOTrainer``'s colocated vLLM engine, and the reference log-probs it scores.

One engine serves both uses of it: ``vllm_ref_log_probs`` (the reference log-probs of the whole dataset computed
once with ``prompt_logprobs``, in place of TRL's ``precompute_ref_log_probs`` forward passes) and ``online`` rounds
(``dpo.online``). Built on first use, at the trainer's policy version; the memory planner reads its size here.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from datasets import Dataset, IterableDataset
from tqdm.auto import tqdm
from transformers.utils import logging

from ..compat.vllm_cpu_lora_scoring import scoring_sync_mode
from ..generation.cpu_environment import running_on_cpu_only
from ..generation.engine import RolloutEngine, build_engine
from ..peft_models import is_peft_model
from .preference_pairs import completion_logprob_sums

logger = logging.get_logger(__name__)

# Examples sent to the engine at a time when it scores reference log-probs (vLLM batches them internally).
REF_SCORING_CHUNK = 512


def build_dpo_engine(trainer: Any) -> RolloutEngine:
    """DPO's colocated engine: the reference scorer (``vllm_ref_log_probs``) and online DPO's sampler."""
    args = trainer.args
    # Sequences longer than the model's positions are truncated by max_length already; the engine may not
    # be configured beyond the model's own limit.
    limit = getattr(trainer.accelerator.unwrap_model(trainer.model).config, "max_position_embeddings", None)
    max_model_length = args.vllm_max_model_length or args.max_length
    if limit is not None and max_model_length is not None:
        max_model_length = min(max_model_length, limit)
    per_step = args.per_device_train_batch_size * args.online_num_generations
    max_num_seqs = per_step if trainer._online else 256
    return build_engine(
        args,
        model=trainer.model,
        accelerator=trainer.accelerator,
        processing_class=trainer.processing_class,
        policy_version=trainer.policy.current,
        phase_timer=trainer.phase_timer,  # its weight syncs are their own phase
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
        if trainer._online
        else scoring_sync_mode(args.vllm_sync_mode, running_on_cpu_only()),
    )


def vllm_reference_logps(trainer: Any, dataset: Dataset, name: str) -> Dataset:
    """``dataset`` with TRL's ``ref_chosen_logps`` / ``ref_rejected_logps`` columns, scored by the engine (each rank a
    share of the examples, gathered), instead of TRL's reference forward passes."""
    if isinstance(dataset, IterableDataset):
        raise ValueError("vllm_ref_log_probs needs a map-style Dataset (it scores every example once).")
    if trainer.ref_model is not None:
        raise ValueError(
            "vllm_ref_log_probs scores the reference with the engine, which holds the policy's initial weights; "
            "an explicit ref_model is not supported there. Pass ref_model=None (the reference is then the "
            "initial policy, or the base of a LoRA policy) or set vllm_ref_log_probs=False."
        )
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    if is_peft_model(unwrapped) and "ref" in unwrapped.peft_config:
        raise ValueError(
            "vllm_ref_log_probs scores the base model, but this PEFT model carries a 'ref' adapter as its "
            "reference; set vllm_ref_log_probs=False to use TRL's reference pass."
        )
    engine = trainer._colocated_engine()
    engine.ensure_version(trainer.policy_version)  # the trainer's weights as they are before any update
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    mine = list(range(rank, len(dataset), world))
    chosen, rejected = [], []
    start = time.perf_counter()
    offsets = tqdm(
        range(0, len(mine), REF_SCORING_CHUNK),
        desc=f"vLLM reference log-probs ({name})",
        unit="chunk",
        disable=not trainer.accelerator.is_main_process or bool(trainer.args.disable_tqdm),
    )
    for offset in offsets:
        rows = [dataset[i] for i in mine[offset : offset + REF_SCORING_CHUNK]]
        batch = trainer.data_collator(rows)  # TRL's collator: its truncation, its completion mask
        sums = completion_logprob_sums(engine, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
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
