"""GPUs for generation vs training when the two run on separate GPUs (disaggregated, as verl's and OpenRLHF's
asynchronous modes do): the split that balances the two so neither waits long for the other.

Per step, generation must produce ``generated_tokens`` at ``generation_tokens_per_s`` per GPU and training must
process ``trained_tokens`` at ``training_tokens_per_s`` per GPU. With g GPUs generating and T - g training, the
step takes max(G / (g * rg), R / ((T - g) * rt)) in a pipelined loop (the two overlap; the slower sets the pace).
The continuous optimum equalises them: g* = T * (G / rg) / (G / rg + R / rt). Integer g is searched around it, in
multiples of the engine's tensor-parallel size.

Assumed throughputs, when none are measured (state them as assumptions): training at 40% MFU, i.e.
0.4 * peak FLOP/s / (6 * active parameters) tokens/s (Kaplan et al. 2020: 6N FLOPs per trained token); generation
memory-bound, one read of the weights per decoding step for the whole batch: batch * bandwidth / weight bytes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Split:
    generation_gpus: int
    training_gpus: int
    generation_seconds: float
    training_seconds: float

    @property
    def step_seconds(self) -> float:
        return max(self.generation_seconds, self.training_seconds)

    @property
    def idle_fraction(self) -> float:
        """Share of the slower side's time the faster side waits."""
        return 1 - min(self.generation_seconds, self.training_seconds) / self.step_seconds


def balance(
    total_gpus: int,
    generated_tokens: float,
    trained_tokens: float,
    generation_tokens_per_s: float,
    training_tokens_per_s: float,
    tensor_parallel_size: int = 1,
) -> Split:
    """The integer split minimising the step time (ties: fewer generation GPUs)."""
    if total_gpus < 2:
        raise ValueError(
            f"--gpus-per-node x --nodes must be at least 2 to split generation from training, got {total_gpus}."
        )
    for name, value in (
        ("--gen-tokens-per-s", generation_tokens_per_s),
        ("--train-tokens-per-s", training_tokens_per_s),
        ("generated tokens", generated_tokens),
        ("trained tokens", trained_tokens),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}.")
    best = None
    for g in range(tensor_parallel_size, total_gpus, tensor_parallel_size):
        split = Split(
            g,
            total_gpus - g,
            generated_tokens / (g * generation_tokens_per_s),
            trained_tokens / ((total_gpus - g) * training_tokens_per_s),
        )
        if best is None or split.step_seconds < best.step_seconds - 1e-12:
            best = split
    if best is None:
        raise ValueError(f"--vllm-tp ({tensor_parallel_size}) leaves no GPU for training out of {total_gpus}.")
    return best


def continuous_optimum(total_gpus: int, generated_tokens: float, trained_tokens: float, rg: float, rt: float) -> float:
    gen_work, train_work = generated_tokens / rg, trained_tokens / rt
    return total_gpus * gen_work / (gen_work + train_work)


def assumed_training_tokens_per_s(active_params: float, peak_tflops: float, mfu: float = 0.4) -> float:
    return mfu * peak_tflops * 1e12 / (6 * active_params)


def assumed_generation_tokens_per_s(weight_bytes: float, bandwidth_tb_s: float, batch: int) -> float:
    return batch * bandwidth_tb_s * 1e12 / weight_bytes
