"""CPU seconds a vLLM server's processes spend per operation of an asynchronous GRPO step, by executor.

One server (the embedded model, fp32, no LoRA, as ``benchmarks/async_grpo.py --server`` starts it), then each
operation ``--repeats`` times: a step's sampling (16 groups x 8 samples of 6 tokens, concurrently, through the
producer's client), a full-weight reload (pause, reload from files, prefix-cache reset, resume) and the verification
probe (prompt log-probs). CPU is the operating system's accounting (``psutil``) of the server's processes over the
operation and the ``--window`` seconds after it, where a spinning reader would keep counting.

``--executor uni`` is what trlx_scale starts on CPU (``compat/vllm_cpu_server_executor.py``); ``--executor mp`` is
vLLM's own choice on CPU, a worker process fed through a shared-memory queue.

    python benchmarks/server_cpu_per_operation.py --executor mp
    python benchmarks/server_cpu_per_operation.py --executor uni

Results and the commands: docs/benchmarks.md ("The CPU server without its spinning worker").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--executor", choices=("uni", "mp"), default="uni")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--window", type=float, default=0.3, help="seconds counted after each operation")
    cli = parser.parse_args()

    import psutil
    from transformers import AutoTokenizer

    from trlx_scale.generation.server_client import SamplingSettings, VLLMServerClient
    from trlx_scale.generation.vllm_server import ServerLaunch, VLLMServerProcess
    from trlx_scale.rollout.async_producer import GroupRequest
    from trlx_scale.tasks import addition_dataset, default_model_path

    model = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = []
    for row in addition_dataset("train", size=16):
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))

    extra = ("--distributed-executor-backend", "mp") if cli.executor == "mp" else ()
    launch = ServerLaunch(model=model, dtype="float32", enable_lora=False, extra_args=extra)
    with VLLMServerProcess(launch, startup_timeout=600) as server, tempfile.TemporaryDirectory() as weights:
        processes = [psutil.Process(server.process.pid), *psutil.Process(server.process.pid).children(recursive=True)]
        titles = [" ".join(process.cmdline())[:40] for process in processes]
        client = VLLMServerClient(
            [server.url],
            model=model,
            sampling=SamplingSettings(
                max_tokens=6, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0
            ),
            prompt_ids=lambda prompt: prompt["prompt_ids"],
        )
        for name in os.listdir(model):  # the served weights themselves, reloaded as a new version
            if name.endswith((".safetensors", ".json")):
                shutil.copy(os.path.join(model, name), weights)
        loop = asyncio.new_event_loop()

        def cpu_seconds() -> float:
            return sum(sum(process.cpu_times()[:2]) for process in processes)

        def measure(operation) -> tuple[float, float]:
            operation()  # warm
            cpu, wall = [], []
            for _ in range(cli.repeats):
                time.sleep(1.5)  # past any busy loop of the operation before
                before, start = cpu_seconds(), time.perf_counter()
                operation()
                wall.append(time.perf_counter() - start)
                time.sleep(cli.window)
                cpu.append(cpu_seconds() - before)
            return statistics.median(cpu), statistics.median(wall)

        async def sample_groups():
            requests = [
                GroupRequest(index=i, prompt={"prompt_ids": ids}, num_generations=8, version=0, seed=i)
                for i, ids in enumerate(prompts)
            ]
            await asyncio.gather(*[client.sample(request) for request in requests])

        version = [0]

        def reload() -> None:
            version[0] += 1
            client.reload_weights(version[0], weights)

        results = {
            "16 groups x 8 samples, 6 tokens": measure(lambda: loop.run_until_complete(sample_groups())),
            "full-weight reload (pause, reload, reset, resume)": measure(reload),
            "verification probe (prompt log-probs)": measure(
                lambda: client.prompt_logprobs(prompts[0] + [5, 6, 7], version[0])
            ),
        }
        loop.close()
    print(f"executor {cli.executor}: server processes {titles}")
    print(f"| operation | CPU s over it and {cli.window} s after (wall s), medians of {cli.repeats} |")
    print("|---|---|")
    for name, (cpu, wall) in results.items():
        print(f"| {name} | {cpu:.2f} ({wall:.3f}) |")


if __name__ == "__main__":
    main()
