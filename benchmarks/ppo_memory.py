"""Per-rank peak memory of PPO (full policy, frozen reference copy, separate full critic) at ~30M parameters:
1 process, 2-process DDP and 2-process DeepSpeed ZeRO-3 (with DeepSpeed's defaults, and with its gathered working set
capped as the defaults cap a model of billions of parameters), side by side (CPU: peak RSS of each rank).

    python benchmarks/ppo_memory.py --repeats 3            # prints the table, writes --out (JSON)

Each run is `accelerate launch` of this script in worker mode on a locally built Llama (4 layers, hidden 512, ~30M
parameters, benchmarks/bench_assets.py), with HF generation (no vLLM engine, whose KV cache is a budget the user sets
and would hide the roles' memory): 3 PPO steps of 4 rows per rank (1 prompt x 4), 16-token prompts, 8-token
completions. A rank reports its peak RSS, its RSS just before the trainer was built (Python, torch, the dataset), and
the difference: what the trainer's roles (policy, critic, reference, their gradients and Adam states, activations)
cost it, and the model states each role holds after training (parameters or their partition, gradients, fp32
masters and Adam moments, counted tensor by tensor). ZeRO-3 partitions every role over the 2 ranks; DDP replicates
them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CAPPED_ZERO3 = "2-process ZeRO-3, working set capped"
SETUPS = {
    "1 process": ["--num_processes", "1"],
    "2-process DDP": ["--config_file", os.path.join(ROOT, "configs", "accelerate", "cpu_ddp.yaml")],
    "2-process ZeRO-3": ["--config_file", os.path.join(ROOT, "configs", "accelerate", "cpu_zero3.yaml")],
    CAPPED_ZERO3: None,  # written at run time by capped_zero3_config()
}
# DeepSpeed's ZeRO-3 defaults keep up to 10^9 gathered parameters live and reuse them within 10^9: a 30M model stays
# gathered whole through its step. These caps make it release each layer after use, as the defaults do for a model
# of billions of parameters: about one decoder layer live (4 layers of ~3.1M), no reuse, no prefetch, 1M-element
# gradient buckets.
CAPPED_ZERO3_SECTION = {
    "stage": 3,
    "stage3_max_live_parameters": 3_000_000,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 0,
    "reduce_bucket_size": 1_000_000,
    "stage3_param_persistence_threshold": "auto",
    "stage3_gather_16bit_weights_on_model_save": True,
}


def capped_zero3_config(directory: str) -> list[str]:
    """An Accelerate config (2 processes, gloo-friendly like cpu_zero3.yaml) whose DeepSpeed JSON caps the gathered
    working set; the batch and clipping values stay "auto" (filled from the PPOConfig)."""
    deepspeed_json = os.path.join(directory, "zero3_capped.json")
    with open(deepspeed_json, "w") as handle:
        json.dump(
            {
                "zero_optimization": CAPPED_ZERO3_SECTION,
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": "auto",
            },
            handle,
            indent=1,
        )
    config = os.path.join(directory, "zero3_capped.yaml")
    with open(config, "w") as handle:
        handle.write(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
            f"  deepspeed_config_file: {deepspeed_json}\n  zero3_init_flag: false\nnum_processes: 2\n"
            "num_machines: 1\nmachine_rank: 0\nmain_training_function: main\nuse_cpu: false\n"
            "rdzv_backend: static\nsame_network: true\n"
        )
    return ["--config_file", config]


PROMPT_TOKENS, COMPLETION_TOKENS = 16, 8


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _current_rss_gib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


class _RSSSampler:
    """The largest current RSS seen by a thread polling /proc every 5 ms (ru_maxrss also counts model loading)."""

    def __init__(self):
        import threading

        self.peak = _current_rss_gib()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, _current_rss_gib())

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return self.peak


def model_state_gib(trainer) -> dict[str, float]:
    """What each role holds on this rank after training (activations freed), as the trainer logs it
    (``memory/held/<role>_gib``, trlx_scale/planning/held_memory.py): parameters or their partition, gradients, fp32
    masters and Adam moments, counted tensor by tensor. DDP's gradient buckets (one more copy of the gradients) are
    not counted."""
    held = trainer.memory_planner.held_memory_metrics()
    return {role: held[f"memory/held/{role}_gib"] for role in ("policy", "critic", "reference")}


def worker(output: str) -> None:
    import random

    from bench_assets import build_model_dir, llama_30m
    from datasets import Dataset

    from trlx_scale import PPOConfig, PPOTrainer
    from trlx_scale.tasks.example_runtime import cpu_launch_defaults

    model_dir = build_model_dir("ppo_memory_30m", llama_30m())
    rng = random.Random(0)
    prompts = [" ".join(f"t{rng.randrange(3, 32000)}" for _ in range(PROMPT_TOKENS)) for _ in range(64)]
    dataset = Dataset.from_dict({"prompt": prompts})

    def reward_length(completions, **kwargs):
        return [float(len(c)) / 100 for c in completions]

    args = PPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=COMPLETION_TOKENS,
        max_steps=3,
        learning_rate=1e-5,
        critic_learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        **cpu_launch_defaults(),  # on CPU: fp32, and the gloo process group (use_cpu under DDP) when launched on 2
        disable_tqdm=True,
        gradient_checkpointing=False,
        profile_phases=False,
    )
    baseline = _current_rss_gib()
    trainer = PPOTrainer(model=model_dir, reward_funcs=reward_length, args=args, train_dataset=dataset)
    # Memory freed after loading (whole models, before ZeRO-3 partitions them) stays in glibc's heap and in the RSS
    # unless trimmed: trimmed here, so the sampler sees what the training steps themselves hold.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    sampler = _RSSSampler()  # the training steps' own peak
    trainer.train()
    training_peak = sampler.stop()

    peak = _rss_gib()
    report = {
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "critic_backend": trainer.critic_training.backend,
        "baseline_gib": baseline,
        "peak_gib": peak,
        "roles_gib": peak - baseline,
        "training_peak_gib": training_peak,
        "model_state_gib": model_state_gib(trainer),
    }
    with open(f"{output}.rank{report['rank']}.json", "w") as handle:
        json.dump(report, handle)


def run_setup(name: str, port: int) -> list[dict]:
    output = os.path.join(tempfile.mkdtemp(), "report")
    env = dict(os.environ)
    for variable in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(variable, None)
    setup = SETUPS[name] or capped_zero3_config(os.path.dirname(output))
    command = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", *setup]
    command += ["--main_process_port", str(port), os.path.abspath(__file__), "--worker", output]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-4000:]}")
    ranks = 1 if name == "1 process" else 2
    reports = []
    for rank in range(ranks):
        with open(f"{output}.rank{rank}.json") as handle:
            reports.append(json.load(handle))
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", metavar="OUTPUT", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=2, help="runs per setup; the table shows medians")
    parser.add_argument("--out", default="ppo_memory.json", help="where the raw per-rank reports go")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    runs = {name: [] for name in SETUPS}
    port = 29780
    for repeat in range(args.repeats):
        for name in SETUPS:  # interleaved: a noisy machine affects every setup alike
            port += 1
            runs[name].append(run_setup(name, port))
            print(f"repeat {repeat + 1}: {name} done", flush=True)
    with open(args.out, "w") as handle:
        json.dump(runs, handle, indent=1)
    print(
        "| setup | critic | per-rank peak RSS (GiB) | before the trainer | roles: peak - before | model states held "
        "(policy + critic + reference, GiB) |"
    )
    print("|---|---|---|---|---|---|")
    for name, repeats in runs.items():
        # The worst rank of each run (the per-rank budget a user must have), median over repeats.
        peak = statistics.median(max(r["peak_gib"] for r in reports) for reports in repeats)
        base = statistics.median(max(r["baseline_gib"] for r in reports) for reports in repeats)
        roles = statistics.median(max(r["roles_gib"] for r in reports) for reports in repeats)
        states = repeats[0][0]["model_state_gib"]  # counted tensor by tensor: the same in every repeat
        held = " + ".join(f"{states[k]:.3f}" for k in ("policy", "critic", "reference"))
        total = sum(states.values())
        backend = repeats[0][0]["critic_backend"]
        print(f"| {name} | {backend} | {peak:.2f} | {base:.2f} | {roles:.2f} | {held} = {total:.3f} |")


if __name__ == "__main__":
    main()
