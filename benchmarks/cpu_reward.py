"""A reward function that computes in Python, for benchmarks/reward_processes.py: ``work`` iterations of integer
arithmetic per completion (the GIL held throughout, as a parser or a math verifier holds it), then the embedded
task's exact match. At the top level of a module, so that a worker process imports it by name."""

from __future__ import annotations


def python_verifier(completions, answer, work: int = 20000, **kwargs) -> list[float]:
    from trlx_scale.tasks import exact_match_reward

    checksum = 0
    for _ in completions:
        for step in range(work):
            checksum = (checksum * 31 + step) % 1_000_003
    return exact_match_reward(completions, answer=answer)
