"""How long a training process takes to end once its work is done: the ordinary interpreter exit against
``trlx_scale.process_exit.run_then_exit`` (the scripts' ending), side by side, interleaved within each repeat, each
run in a process of its own on the embedded model.

Two workloads: ``import`` (a script that imports TRL's GRPOTrainer and trlx_scale's trainers and ends: the floor any
training script pays) and ``ppo`` (examples/ppo.py for one step in one process: a colocated vLLM engine, whose
shutdown is among the exit handlers both endings run). Reported per workload and ending: the seconds from the end
of the script's work (a timestamp it prints) to the end of its process, medians of ``--repeats``.

    python benchmarks/process_exit.py --repeats 3

Results and the command: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORK = {
    "import": "from trl import GRPOTrainer\nimport trlx_scale.grpo.trainer\n",
    "ppo": (
        "from trlx_scale.scripts.ppo import main as run_example\n"
        "run_example(['--max_steps', '1', '--eval_size', '8', '--per_device_train_batch_size', '16',\n"
        "             '--logging_steps', '1', '--report_to', 'none', '--output_dir', {output_dir!r}])\n"
    ),
}
ENDINGS = {
    "ordinary": "def main():\n{body}\nmain()\nprint('WORK_DONE', time.time(), flush=True)\n",
    "run_then_exit": (
        "from trlx_scale.process_exit import run_then_exit\n"
        "def main():\n{body}\n    print('WORK_DONE', time.time(), flush=True)\n"
        "run_then_exit(main)\n"
    ),
}


def exit_seconds(workload: str, ending: str) -> float:
    """One run in a new process: seconds from its WORK_DONE timestamp to the end of the process."""
    with tempfile.TemporaryDirectory() as output_dir:
        body = "\n".join("    " + line for line in WORK[workload].format(output_dir=output_dir).splitlines())
        code = "import time\n" + ENDINGS[ending].format(body=body)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
        )
        ended = time.time()
    if result.returncode != 0:
        raise RuntimeError(f"{workload}/{ending} exited {result.returncode}:\n{result.stderr[-3000:]}")
    line = next(line for line in result.stdout.splitlines() if line.startswith("WORK_DONE"))
    return ended - float(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=list(WORK), choices=list(WORK))
    cli = parser.parse_args()
    results = {(workload, ending): [] for workload in cli.workloads for ending in ENDINGS}
    for repeat in range(cli.repeats):
        for workload in cli.workloads:
            for ending in ENDINGS:
                seconds = exit_seconds(workload, ending)
                results[workload, ending].append(seconds)
                print(f"repeat {repeat + 1}: {workload:6s} {ending:13s} {seconds:6.2f} s to exit", flush=True)
    print("\nworkload  ending         exit s (median)  runs")
    for workload in cli.workloads:
        medians = {ending: statistics.median(results[workload, ending]) for ending in ENDINGS}
        for ending in ENDINGS:
            runs = " ".join(f"{value:.2f}" for value in results[workload, ending])
            print(f"{workload:8s}  {ending:13s}  {medians[ending]:15.2f}  {runs}")
        print(f"{workload:8s}  saved per process: {medians['ordinary'] - medians['run_then_exit']:.2f} s")


if __name__ == "__main__":
    main()
