"""Reference log-probs of a DPO dataset: vLLM `prompt_logprobs` (vllm_ref_log_probs) vs TRL's forward passes.

Both paths score the same collated pairs (TRL's `DataCollatorForPreference`, same truncation) with the same weights:
TRL's `compute_ref_log_probs` over a DataLoader (what `precompute_ref_log_probs=True` runs), and the colocated engine
through `trlx_scale.dpo.preference_pairs.completion_logprob_sums`. Each repeat times both back to back (order
alternating); medians and the median of the per-repeat ratios are printed, with the engine's one-time start-up and
the largest per-sequence disagreement.

    python benchmarks/dpo_ref_logprobs.py --pairs 2000 --repeats 3

Results and the command: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from trlx_scale import DPOConfig, DPOTrainer  # noqa: E402
from trlx_scale.dpo.preference_pairs import completion_logprob_sums  # noqa: E402
from trlx_scale.dpo.reference_engine import REF_SCORING_CHUNK  # noqa: E402
from trlx_scale.tasks import addition_preference_dataset, default_model_path  # noqa: E402


def trl_pass(trainer: DPOTrainer, batch_size: int) -> torch.Tensor:
    loader = DataLoader(trainer.train_dataset, batch_size=batch_size, collate_fn=trainer.data_collator)
    sums = []
    with torch.no_grad():
        for batch in loader:
            chosen, rejected = trainer.compute_ref_log_probs(trainer.model, batch)
            sums.append(torch.stack([chosen, rejected], dim=1))
    return torch.cat(sums)


def vllm_pass(trainer: DPOTrainer) -> torch.Tensor:
    engine = trainer._colocated_engine()
    dataset = trainer.train_dataset
    sums = []
    for start in range(0, len(dataset), REF_SCORING_CHUNK):
        rows = [dataset[i] for i in range(start, min(start + REF_SCORING_CHUNK, len(dataset)))]
        batch = trainer.data_collator(rows)
        values = completion_logprob_sums(engine, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        sums.append(torch.tensor([values[: len(rows)], values[len(rows) :]], dtype=torch.float64).T)
    return torch.cat(sums)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trl-batch-size", type=int, default=64, help="TRL's precompute_ref_batch_size")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as output_dir:
        config = DPOConfig(output_dir=output_dir, bf16=False, report_to="none", max_length=64, vllm_dtype="float32")
        trainer = DPOTrainer(
            model=default_model_path(), args=config, train_dataset=addition_preference_dataset("train", args.pairs)
        )
        trainer.model.eval()
        start = time.perf_counter()
        engine = trainer._colocated_engine()
        engine.sync_weights()
        startup = time.perf_counter() - start
        timings = {"trl": [], "vllm": []}
        results = {}
        for repeat in range(args.repeats):
            for name in ("trl", "vllm") if repeat % 2 == 0 else ("vllm", "trl"):
                start = time.perf_counter()
                results[name] = trl_pass(trainer, args.trl_batch_size) if name == "trl" else vllm_pass(trainer)
                timings[name].append(time.perf_counter() - start)
        gap = (results["trl"].double() - results["vllm"]).abs().max().item()
        ratios = [t / v for t, v in zip(timings["trl"], timings["vllm"], strict=True)]
        print(
            f"embedded model (fp32), {len(trainer.train_dataset)} pairs ({2 * len(trainer.train_dataset)} sequences), "
            f"threads {torch.get_num_threads()}, {args.repeats} repeats; TRL batch size {args.trl_batch_size}; "
            f"engine start-up + weight sync {startup:.1f} s (once); max |difference| {gap:.2e} nats per sequence"
        )
        print("| path | seconds (median) | speed-up vs TRL (median of ratios) |")
        print("|---|---|---|")
        print(f"| TRL forward passes (precompute_ref_log_probs) | {statistics.median(timings['trl']):.2f} | 1.00x |")
        print(
            f"| vLLM prompt_logprobs (vllm_ref_log_probs) | {statistics.median(timings['vllm']):.2f} | "
            f"{statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f}) |"
        )


if __name__ == "__main__":
    main()
