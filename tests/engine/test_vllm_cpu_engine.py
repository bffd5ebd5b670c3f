"""The default model in the real vLLM CPU engine: same greedy answers and log-probs as transformers."""

import torch
from vllm import SamplingParams

from trlx_scale.tasks.addition import split_problems
from trlx_scale.tasks.evaluation import greedy_completions, render_prompt


def _vllm_greedy(llm, prompt_ids, max_tokens=6):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    return [o.outputs[0] for o in outputs]


def test_vllm_and_transformers_agree_on_greedy_answers_and_logprobs(vllm_engine, default_model, default_tokenizer):
    _, held_out = split_problems()
    problems = held_out[:16]
    prompts = [[{"role": "user", "content": p.question}] for p in problems]
    prompt_ids = [
        default_tokenizer(render_prompt(default_tokenizer, p), add_special_tokens=False)["input_ids"] for p in prompts
    ]
    vllm_outputs = _vllm_greedy(vllm_engine, prompt_ids)
    hf_texts = greedy_completions(default_model, default_tokenizer, prompts, max_new_tokens=6)
    assert [o.text.strip() for o in vllm_outputs] == [t.strip() for t in hf_texts]

    # Log-probs of the sampled tokens: fp32 on both sides, so only kernel rounding separates them.
    gaps = []
    for ids, output in zip(prompt_ids, vllm_outputs, strict=True):
        full = torch.tensor([ids + list(output.token_ids)])
        with torch.no_grad():
            logps = torch.log_softmax(default_model(full).logits[0].float(), dim=-1)
        for i, token in enumerate(output.token_ids):
            gaps.append(abs(logps[len(ids) - 1 + i, token].item() - output.logprobs[i][token].logprob))
    assert max(gaps) < 1e-4, max(gaps)
