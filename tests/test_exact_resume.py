"""Exact resume, for every trainer: 4 steps straight vs. a new process resuming from the straight run's step-1
checkpoint for steps 2-4. Every logged metric except timings (losses, rewards, gradient norms, KL coefficient, value
loss, token counts, ...) must be identical: bit-exact on CPU, where each process runs the same arithmetic in the same
order. Resuming at step 1 of GRPO-with-engine falls in the middle of a rollout (2 mini-batches per rollout), so the
rollout buffer, the micro-step counter and the engine's per-request seeds are all exercised."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from trlx_scale.generation.rollout_seeds import RolloutSeedContext, request_seed
from trlx_scale.ppo.checkpoint_state import PPO_STATE_NAME
from trlx_scale.reliability import CHECKPOINT_COMPLETE_MARKER

from .helpers.launch import LAUNCH_VARIABLES, REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "tests", "scripts", "resume_run.py")
KINDS = [
    "grpo_lora_engine",
    "grpo_full_masters",
    "ppo_separate",
    "ppo_shared_base",
    "ppo_full",
    "dpo_offline",
    "dpo_online",
    "grpo_dynamic_sampling",
]


def _run(kind: str, output_dir, resume=None, expect_failure: bool = False) -> dict | str:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1")
    for name in LAUNCH_VARIABLES:
        env.pop(name, None)
    command = [sys.executable, SCRIPT, kind, str(output_dir), "--max_steps", "4"]
    if resume is not None:
        command += ["--resume", str(resume)]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    if expect_failure:
        assert result.returncode != 0
        return result.stderr
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


_STRAIGHT_RUNS: dict[str, tuple] = {}  # kind -> (output directory, logs): PPO's refusal test reuses its run


def _straight(kind: str, tmp_path_factory) -> tuple:
    """The uninterrupted run, in this process (the run that resumes is the one that must start from nothing: a new
    process; this one would only spend 15-25 s importing torch, TRL and vLLM again)."""
    if kind not in _STRAIGHT_RUNS:
        out = tmp_path_factory.mktemp(f"straight_{kind}")
        spec = importlib.util.spec_from_file_location("resume_run", SCRIPT)
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        _STRAIGHT_RUNS[kind] = (out, script.run(kind, str(out), max_steps=4))
    return _STRAIGHT_RUNS[kind]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_resumed_run_repeats_the_uninterrupted_one_exactly(kind, tmp_path, tmp_path_factory):
    out, straight = _straight(kind, tmp_path_factory)
    resumed = _run(kind, tmp_path / "resumed", resume=out / "checkpoint-1")
    assert sorted(straight) == ["1", "2", "3", "4"]
    for step in ("2", "3", "4"):
        assert "loss" in straight[step]
        assert resumed[step] == straight[step], step
    trained = {"grpo": "reward", "ppo": "ppo/value_loss", "dpo": "rewards/margins"}[kind.split("_")[0]]
    assert any(trained in straight[step] for step in ("2", "3", "4")), trained
    if kind == "grpo_dynamic_sampling":  # step 2 trains a group step 1 carried over: the checkpoint held it
        assert straight["2"]["batch/carried_groups"] > 0 and straight["2"]["batch/filled_frac"] == 1.0


@pytest.mark.slow
def test_ppo_refuses_to_resume_without_its_critic(tmp_path, tmp_path_factory):
    out, _ = _straight("ppo_separate", tmp_path_factory)  # the exact-resume test's run: this test damages a copy
    checkpoint = tmp_path / "straight" / "checkpoint-1"
    shutil.copytree(out / "checkpoint-1", checkpoint)
    os.remove(checkpoint / PPO_STATE_NAME)
    # The completion marker's checksums see the missing file first and name it ...
    stderr = _run("ppo_separate", tmp_path / "resumed", resume=checkpoint, expect_failure=True)
    assert f"is damaged: {PPO_STATE_NAME} is missing" in stderr
    # ... and a checkpoint whose marker records no checksums (an older trlx_scale's) meets PPO's own check.
    marker = checkpoint / CHECKPOINT_COMPLETE_MARKER
    marker.write_text(
        json.dumps({key: value for key, value in json.loads(marker.read_text()).items() if key != "files"})
    )
    stderr = _run("ppo_separate", tmp_path / "resumed", resume=checkpoint, expect_failure=True)
    assert f"has no {PPO_STATE_NAME} (the critic, its optimizer and the KL coefficient)" in stderr
    shutil.rmtree(tmp_path / "straight")


def test_request_seeds_depend_on_seed_step_mode_global_row_and_prompt_only():
    context = RolloutSeedContext(seed=1, rank=0, step=5)
    seed = request_seed(context, [3, 4, 5], 0)
    assert seed == request_seed(RolloutSeedContext(1, 0, 5), [3, 4, 5], 0)  # a function of its inputs alone
    assert 0 <= seed < 2**63
    # The rank enters only through the global row (GroupedLLM: rank x rows + local row): rank 1's row 0 of 8 is
    # global row 8, whatever the number of processes.
    assert request_seed(RolloutSeedContext(1, 1, 5), [3, 4, 5], 8) == request_seed(context, [3, 4, 5], 8)
    others = {
        request_seed(RolloutSeedContext(2, 0, 5), [3, 4, 5], 0),
        request_seed(RolloutSeedContext(1, 0, 6), [3, 4, 5], 0),
        request_seed(RolloutSeedContext(1, 0, 5, "eval"), [3, 4, 5], 0),
        request_seed(context, [3, 4, 6], 0),
        request_seed(context, [3, 4, 5], 1),
    }
    assert seed not in others and len(others) == 5
