"""The planner against measurement: every trainer logs `memory/planned_peak_gib` (this run's plan) beside the
process's measured peak, and on CPU (roles in host RAM) the two must agree.

Tolerances, from the runs that set them (docs/planning.md "Checked against measurement"):
- embedded model, GRPO example (LoRA, vLLM colocated), 1 process and 2-process ZeRO-3: 15 % of the measured peak.
  There the vLLM engine's KV cache (1 GiB) and the process runtime dominate; the model's own terms are megabytes.
- a 34M-parameter Llama, DPO full fine-tuning in fp32 with a reference model (the model terms are 0.6 GiB of 1.4
  in one process): 10 % in 1 process; 20 % under 2-process ZeRO-3, where DeepSpeed's buckets and the C heap's
  retention after partitioning a fully loaded model are not modelled (measured 14-17 % above the plan).
"""

import json
import os

import pytest

from .helpers.launch import ACCELERATE_LAUNCH, REPO_ROOT, run_command

ZERO3 = os.path.join(REPO_ROOT, "configs", "accelerate", "cpu_zero3.yaml")
SINGLE = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
DPO_SCRIPT = os.path.join(REPO_ROOT, "tests", "distributed", "dpo_memory_plan.py")


def _relative_gap(planned: float, measured: float) -> float:
    return abs(planned - measured) / measured


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("processes", [1, 2], ids=["1-process", "zero3-2-processes"])
def test_grpo_example_plan_matches_measured_peak(tmp_path, processes, request):
    """3 steps of examples/grpo.py; the 1-process run is the session's (conftest.grpo_example_three_steps)."""
    if processes == 1:
        out, printed = request.getfixturevalue("grpo_example_three_steps")
    else:
        out = tmp_path / "run"
        example = os.path.join(REPO_ROOT, "examples", "grpo.py")
        arguments = [example, "--max_steps", "3", "--eval_size", "40", "--output_dir", str(out)]
        printed = run_command([*ACCELERATE_LAUNCH, "--config_file", ZERO3, *arguments], timeout=800).stdout
    with open(out / "run_summary.json") as handle:
        summary = json.load(handle)
    planned, measured = summary["memory_planned_peak_gib"], summary["memory_measured_peak_gib"]
    assert "GiB planned (trlx-scale plan)" in printed
    assert _relative_gap(planned, measured) < 0.15, (planned, measured)


@pytest.fixture(scope="module")
def llama_34m(tmp_path_factory):
    """A 34,087,424-parameter Llama (8 layers, hidden 512, vocabulary 8192), random weights, saved locally."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trlx_scale.tasks.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama34m")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _dpo_reports(tmp_path, launch, model_dir):
    report = tmp_path / "report.json"
    run_command([*ACCELERATE_LAUNCH, *launch, DPO_SCRIPT, model_dir, str(report)], timeout=900)
    paths = [report] if report.exists() else sorted(tmp_path.glob("report.json.rank*"))
    return [json.loads(p.read_text()) for p in paths]


@pytest.mark.slow
@pytest.mark.distributed
def test_dpo_plan_matches_measured_peak_where_the_model_dominates(tmp_path, llama_34m):
    (single,) = _dpo_reports(tmp_path / "one", SINGLE, llama_34m)
    assert single["backend"] == "ddp" and single["params"] == 34_087_424
    model_terms = single["planned_peak_gib"] - single["runtime_baseline_gib"]
    assert model_terms > 0.5  # the formulas, not the interpreter's constant, decide this comparison
    assert _relative_gap(single["planned_peak_gib"], single["measured_peak_gib"]) < 0.10, single

    sharded = _dpo_reports(tmp_path / "zero3", ["--config_file", ZERO3], llama_34m)
    assert len(sharded) == 2 and all(r["backend"] == "zero3" for r in sharded)
    for rank in sharded:
        assert _relative_gap(rank["planned_peak_gib"], rank["measured_peak_gib"]) < 0.20, rank
        # Each rank plans (and holds) half of the policy's training state.
        state = sum(rank["roles_gib"][k] for k in ("policy weights", "policy gradients"))
        assert state == pytest.approx(sum(single["roles_gib"][k] for k in ("policy weights", "policy gradients")) / 2)
