"""The GSPO behaviour weight on long sequences of an unchanged policy: the product of token weights against the
geometric mean.

Under asynchronous GRPO with GSPO (``importance_sampling_level="sequence"``), the weight pi_prox / pi_behave
corrects a whole sequence. TRL's sequence modes take the product of the token ratios, exp(sum_t d_t) with
d_t = log pi_prox(y_t) - log pi_behave(y_t). With an unchanged policy (``max_staleness=0``) the only differences
are the engine's numerics, and the weight should be 1. A sum over thousands of tokens of small, partly biased
differences drifts anyway, until the weight leaves the clip bounds and the sequence is truncated or masked for no
reason. The geometric mean, exp(mean_t d_t), is GSPO's own normalisation of its ratio
(the decoupled objective's, docs/async.md).

The measurement:
1. The embedded model is served by the real vLLM CPU engine in bfloat16: a 16-bit engine against an fp32 trainer,
   the gap GPUs have between a bf16 engine and fp32 master weights.
2. ``--samples`` completions are sampled at temperature 1 to the model's length (``ignore_eos``). Every sampled
   token's d_t is taken against the fp32 model's own log-prob, the same weights.
3. Sequences of ``--lengths`` tokens are built from blocks of the measured sequences, drawn at random, which keeps
   their correlation within a block. For each length, the script reports the share of sequences whose weight lies
   outside ``[1 / clip, clip]`` (clip: ``vllm_importance_sampling_clip_max``, 3) for each rule, and the median
   |log weight|. Each figure is the median over ``--repeats`` resamplings.

    python benchmarks/gspo_sequence_weight.py --samples 64 --repeats 5

Results and the command: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
# A small KV cache on CPU (unset, vLLM reserves most of the RAM) and the engine core in this process.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def measured_differences(samples: int, seed: int) -> list[list[float]]:
    """Per sampled token, log p_fp32 - log p_engine(bf16), for ``samples`` completions of the addition prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from trlx_scale.tasks import addition_dataset, default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=seed)
    rows = addition_dataset("train", size=samples)
    texts = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False) for row in rows]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [
            SamplingParams(max_tokens=256 - len(p), temperature=1.0, logprobs=0, ignore_eos=True, seed=seed + i)
            for i, p in enumerate(prompts)
        ],
    )
    differences = []
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        engine = [entry[token].logprob for entry, token in zip(completion.logprobs, ids, strict=True)]
        sequence = torch.tensor([prompt + ids])
        with torch.no_grad():
            logps = torch.log_softmax(model(input_ids=sequence).logits[0, :-1].float(), -1)
        start = len(prompt)
        trainer = logps[start - 1 :].gather(-1, sequence[0, start:, None])[:, 0].tolist()
        differences.append([t - e for t, e in zip(trainer, engine, strict=True)])
    return differences


def weights_outside(differences: list[list[float]], length: int, clip: float, count: int, rng: random.Random):
    """Build ``count`` sequences of ``length`` tokens from random measured blocks; per rule, the share outside the
    clip bounds and the median |log weight|."""
    bound = math.log(clip)
    product_out, mean_out, product_abs, mean_abs = 0, 0, [], []
    for _ in range(count):
        total, tokens = 0.0, 0
        while tokens < length:
            block = rng.choice(differences)
            take = block[: length - tokens]
            total += sum(take)
            tokens += len(take)
        product_abs.append(abs(total))
        mean_abs.append(abs(total / tokens))
        product_out += abs(total) > bound
        mean_out += abs(total / tokens) > bound
    return {
        "product_outside": product_out / count,
        "geometric_mean_outside": mean_out / count,
        "product_median_abs_log_weight": statistics.median(product_abs),
        "geometric_mean_median_abs_log_weight": statistics.median(mean_abs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--clip", type=float, default=3.0)
    parser.add_argument("--sequences", type=int, default=2000, help="sequences built per length and repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    differences = measured_differences(cli.samples, cli.seed)
    flat = [d for sequence in differences for d in sequence]
    print(
        f"measured {len(flat)} tokens in {len(differences)} sequences: mean d = {statistics.mean(flat):+.4g}, "
        f"mean |d| = {statistics.mean(abs(d) for d in flat):.4g}, std = {statistics.pstdev(flat):.4g}"
    )
    print(
        f"| tokens | outside [1/{cli.clip:g}, {cli.clip:g}]: product | geometric mean | median abs log weight: "
        "product | geometric mean |"
    )
    print("|---|---|---|---|---|")
    for length in cli.lengths:
        runs = [
            weights_outside(differences, length, cli.clip, cli.sequences, random.Random(cli.seed * 1000 + repeat))
            for repeat in range(cli.repeats)
        ]
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(
            f"| {length} | {median['product_outside']:.1%} | {median['geometric_mean_outside']:.1%} | "
            f"{median['product_median_abs_log_weight']:.3g} | {median['geometric_mean_median_abs_log_weight']:.3g} |"
        )


if __name__ == "__main__":
    main()
