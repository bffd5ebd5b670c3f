"""vLLM's CPU engine with seeded requests whose prompts pass one prefill chunk: prints OK or the error's message.

python tests/scripts/seeded_chunked_prefill.py chunked|whole
"""

import os
import sys

os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from vllm import LLM, SamplingParams  # noqa: E402

from trlx_scale.tasks.default_model import default_model_path  # noqa: E402

if __name__ == "__main__":
    kwargs = dict(model=default_model_path(), dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    kwargs["max_num_batched_tokens"] = 4096
    if sys.argv[1] == "whole":
        kwargs["enable_chunked_prefill"] = False  # what ColocatedVLLMGeneration.llm_kwargs sets on CPU
    llm = LLM(**kwargs)
    prompts = [{"prompt_token_ids": [5 + (i + j) % 50 for j in range(96)]} for i in range(64)]  # 6144 tokens > 4096
    try:
        llm.generate(prompts, [SamplingParams(max_tokens=4, seed=i) for i in range(64)], use_tqdm=False)
        print("RESULT OK")
    except RuntimeError as error:
        print(f"RESULT {error}")
