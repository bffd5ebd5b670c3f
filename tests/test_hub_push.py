"""Pushing to the Hub, against a local fake Hub (tests/helpers/fake_hub.py; HF_ENDPOINT points at it): what goes up
(adapter, or merged weights that plain transformers loads with the same logits), the model card (trainer, settings,
metrics, accuracy), no stale files, and a failing server: retries, then a clear error with everything still local."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from trlx_scale import DPOTrainer, GRPOTrainer, PPOConfig, PPOTrainer
from trlx_scale.hub.push import with_retries
from trlx_scale.tasks import addition_dataset, addition_preference_dataset, exact_match_reward

from .helpers.fake_hub import FakeHub
from .helpers.launch import LAUNCH_VARIABLES, REPO_ROOT
from .helpers.trainers import small_dpo_config, small_grpo_config

LORA = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")


def alternating_reward(completions, **kwargs):
    """Varies within each group, so one step does move the adapter."""
    return [float(index % 2) for index in range(len(completions))]


def _grpo(default_model_dir, tmp_path, **overrides):
    args = small_grpo_config(
        tmp_path, max_steps=1, hub_model_id="tester/grpo-run", hub_push_backoff_s=0.01, **overrides
    )
    return GRPOTrainer(
        default_model_dir, exact_match_reward, args, train_dataset=addition_dataset("train", size=16), peft_config=LORA
    )


def test_lora_run_pushes_its_adapter_card_and_summary_and_no_stale_file(default_model_dir, tmp_path, fake_hub):
    (tmp_path / "notes-from-an-old-run.txt").write_text("stale")
    (tmp_path / "run_summary.json").write_text(json.dumps({"accuracy_before": 0.25, "accuracy_after": 0.5}))
    trainer = _grpo(default_model_dir, tmp_path, optim_preset="grpo_lora", shared_prefix="true")
    trainer.train()
    trainer.push_to_hub(dataset_name="trlx_scale/addition")
    files = fake_hub.repos["tester/grpo-run"]
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "run_summary.json"} <= set(files)
    assert "notes-from-an-old-run.txt" not in files and "model.safetensors" not in files
    assert not any(name.startswith(("checkpoint-", "_hub_staging")) for name in files)
    card = files["README.md"].decode()
    assert "GRPO" in card and "## trlx_scale" in card
    assert "`optim_preset`: `grpo_lora`" in card and "`shared_prefix`: `true`" in card
    assert "| loss |" in card and "| reward |" in card
    assert "Held-out accuracy: 25.0% before training, 50.0% after." in card
    assert not (tmp_path / "_hub_staging").exists()  # cleaned up after a successful push


def test_push_merged_gives_a_plain_model_with_the_same_logits(default_model_dir, tmp_path, fake_hub):
    # temperature 3: a group of distinct completions (identical ones would cancel in the gradient)
    trainer = _grpo(default_model_dir, tmp_path, push_merged=True, learning_rate=1e-2, temperature=3.0)
    trainer.train()
    trainer.push_to_hub()
    files = fake_hub.repos["tester/grpo-run"]
    assert {"model.safetensors", "config.json", "README.md"} <= set(files)
    assert "adapter_model.safetensors" not in files
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    for name, content in files.items():
        (downloaded / name).write_bytes(content)
    plain = AutoModelForCausalLM.from_pretrained(downloaded, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, trainer.model(ids).logits, rtol=1e-5, atol=1e-5)
        base = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
        assert not torch.allclose(base(ids).logits, plain(ids).logits)  # the adapter's training is in it
    assert hasattr(trainer.model, "peft_config")  # the trainer's own model keeps its adapter


def test_ppo_card_names_ppo_and_its_paper(default_model_dir, tmp_path, fake_hub):
    args = small_grpo_config(
        tmp_path, PPOConfig, max_steps=1, hub_model_id="tester/ppo-run", critic_learning_rate=1e-3
    )
    trainer = PPOTrainer(
        default_model_dir, exact_match_reward, args, addition_dataset("train", size=16), peft_config=LORA
    )
    trainer.train()
    trainer.push_to_hub()
    card = fake_hub.repos["tester/ppo-run"]["README.md"].decode()
    assert "PPO" in card and "Proximal Policy Optimization Algorithms" in card
    assert "DeepSeekMath" not in card and "GRPO" not in card.replace("trlx_scale", "")
    assert "Trained with trlx_scale's `PPOTrainer`" in card and "| ppo/value_loss |" in card


def test_dpo_card_names_dpo(default_model_dir, tmp_path, fake_hub):
    args = small_dpo_config(tmp_path, max_steps=1, hub_model_id="tester/dpo-run")
    trainer = DPOTrainer(
        default_model_dir, args=args, train_dataset=addition_preference_dataset(size=16), peft_config=LORA
    )
    trainer.train()
    trainer.push_to_hub()
    card = fake_hub.repos["tester/dpo-run"]["README.md"].decode()
    assert "Trained with trlx_scale's `DPOTrainer`" in card and "Direct Preference Optimization" in card


def test_upload_goes_through_after_server_errors(default_model_dir, tmp_path, fake_hub):
    fake_hub.fail_next = 2
    trainer = _grpo(default_model_dir, tmp_path, hub_push_retries=3)
    trainer.train()
    trainer.push_to_hub()
    assert "adapter_model.safetensors" in fake_hub.repos["tester/grpo-run"]
    commits = [path for method, path in fake_hub.requests if "/commit/" in path]
    assert (
        len(commits) == 3
    )  # two HTTP 500s (huggingface_hub's own retries absorb them), then the one that went through


def test_backoff_doubles_and_client_errors_are_not_retried():
    from huggingface_hub.errors import HfHubHTTPError

    class Response:
        def __init__(self, status):
            self.status_code = status
            self.headers = {}
            self.request = None

    waits: list[float] = []
    calls = []

    def flaky():
        calls.append(1)
        raise HfHubHTTPError("server", response=Response(503))

    with pytest.raises(HfHubHTTPError):
        with_retries(flaky, "upload", retries=3, backoff_s=0.5, sleep=waits.append)
    assert waits == [0.5, 1.0, 2.0] and len(calls) == 4

    def unauthorized():
        calls.append(1)
        raise HfHubHTTPError("denied", response=Response(401))

    calls.clear()
    with pytest.raises(HfHubHTTPError):
        with_retries(unauthorized, "upload", retries=3, backoff_s=0.5, sleep=waits.append)
    assert len(calls) == 1


@pytest.mark.slow
def test_failed_push_keeps_the_local_save_summary_and_printed_summary(tmp_path):
    """examples/grpo.py --push_to_hub against a Hub whose commits always fail with a server error. HTTP 507: a 5xx
    that trlx_scale retries (every status >= 500) and huggingface_hub does not (its own backoff retries 500 and
    502-504 five times, 23 s per commit, which made this test 107 s long without checking anything more)."""
    out = tmp_path / "run"
    with FakeHub() as hub:
        hub.fail_next = 1000
        hub.fail_status = 507
        env = dict(
            os.environ,
            HF_ENDPOINT=hub.url,
            HF_TOKEN="hf_fake_token",
            TOKENIZERS_PARALLELISM="false",
            VLLM_CPU_KVCACHE_SPACE="1",
        )
        for name in LAUNCH_VARIABLES:
            env.pop(name, None)
        command = [
            sys.executable,
            os.path.join(REPO_ROOT, "examples", "grpo.py"),
            "--max_steps",
            "1",
            "--eval_size",
            "8",
            "--output_dir",
            str(out),
            "--push_to_hub",
            "--hub_model_id",
            "tester/failing",
            "--hub_push_retries",
            "2",
            "--hub_push_backoff_s",
            "0.05",
        ]
        result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode != 0
    assert "HubPushError: Pushing to the Hub repo tester/failing failed" in result.stderr
    assert f"Nothing is lost: the model, its card and run_summary.json are in {out}" in result.stderr
    # hub_push_retries=2: the upload is tried three times, each one commit.
    commits = len([path for _, path in hub.requests if "/commit/" in path])
    assert commits == 3
    for name in ("adapter_model.safetensors", "run_summary.json", "README.md", "trainer_state.json"):
        assert (out / name).is_file(), name
    assert "held-out acc." in result.stdout  # the printed summary came before the push
    assert hub.repos.get("tester/failing", {}) == {}
