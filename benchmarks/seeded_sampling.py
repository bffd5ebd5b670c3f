"""The cost of per-request seeds (``vllm_per_request_seed``, on by default) in a GRPO step's generation.

vLLM samples a request that carries its own ``seed`` with a generator of its own instead of the batch-wide one.
This measures a GRPO step's generation through trlx_scale's ``GroupedLLM`` (the object the colocated engine hands to
TRL: each group's prompt sent once with n samples) with and without per-request seeds, in one process, alternating
the two within each repeat: a ~30M-parameter Llama (benchmarks/bench_assets.py) in fp32, 4 prompts of 256 tokens x 8
samples x 64 tokens (the step benchmark's shape). Reports the median seconds of each and their ratio.

    python benchmarks/seeded_sampling.py --repeats 7 --json-out /tmp/seeded_sampling.json

Results and the command: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--json-out", default=None)
    cli = parser.parse_args()

    from bench_assets import build_model_dir, dump, llama_30m
    from vllm import LLM, SamplingParams

    from trlx_scale.generation.grouped_llm import GroupedLLM
    from trlx_scale.generation.rollout_seeds import RolloutSeedContext

    path = build_model_dir("llama_30m", llama_30m())
    llm = GroupedLLM(
        LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=512, enable_prefix_caching=True, seed=0)
    )
    rng = random.Random(0)
    params = SamplingParams(n=1, max_tokens=cli.completion_length, temperature=1.0, ignore_eos=True)
    seconds: dict[str, list[float]] = {"engine_generator": [], "per_request_seed": []}
    for repeat in range(cli.repeats + 1):  # the first repeat warms up and is not counted
        prompts = [[rng.randrange(2, 32000) for _ in range(cli.prompt_length)] for _ in range(cli.prompts)]
        rows = [{"prompt_token_ids": p} for p in prompts for _ in range(cli.group)]
        order = ["engine_generator", "per_request_seed"]
        for variant in order if repeat % 2 == 0 else order[::-1]:
            llm.seed_context = RolloutSeedContext(0, 0, repeat) if variant == "per_request_seed" else None
            llm.inner.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate(rows, sampling_params=params)
            elapsed = time.perf_counter() - start
            assert len(outputs) == len(rows)
            if repeat > 0:
                seconds[variant].append(elapsed)
    medians = {variant: statistics.median(values) for variant, values in seconds.items()}
    ratio = medians["per_request_seed"] / medians["engine_generator"]
    for variant, values in seconds.items():
        print(f"{variant:18s} median {medians[variant]:.3f} s  ({', '.join(f'{v:.3f}' for v in values)})")
    print(f"per-request seeds / engine generator: {ratio:.3f}")
    if cli.json_out:
        dump(cli.json_out, {"seconds": seconds, "medians": medians, "ratio": ratio, "config": vars(cli)})


if __name__ == "__main__":
    main()
