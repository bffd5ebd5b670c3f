"""No secret in any byte that leaves the machine: a run with a token set in every way a user can set it trains,
pushes checkpoints during training (hub_strategy="checkpoint") and pushes at the end against the local fake Hub;
every byte the Hub received, every file it holds, and everything the run printed is searched for every token.

Before the fix this failed on ``training_args.bin`` (transformers pickles the whole TrainingArguments, hub_token in
clear) in the final push and in each checkpoint push."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from peft import LoraConfig

from trlx_scale import DPOTrainer, GRPOTrainer
from trlx_scale.hub.secrets import (
    SecretInUploadError,
    check_folder_has_no_secrets,
    check_tracker_uploads,
    environment_secrets,
    file_holds_any,
    files_with_secrets,
    known_secrets,
    secret_field_names,
    without_secrets,
)
from trlx_scale.tasks import addition_dataset, addition_preference_dataset, exact_match_reward

from .helpers.fake_hub import FakeHub
from .helpers.trainers import small_dpo_config, small_grpo_config

LORA = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
# One distinct token per way of setting it, so a hit says which way leaked.
TOKENS = {
    "config hub_token": "hf_CONFIGtoken0123456789abcdef",
    "HF_TOKEN": "hf_ENVtoken0123456789abcdefgh",
    "HUGGING_FACE_HUB_TOKEN": "hf_LEGACYenv0123456789abcdefg",
    "login file (HF_TOKEN_PATH)": "hf_LOGINfile0123456789abcdef",
    "push_to_hub(token=...)": "hf_PUSHarg0123456789abcdefghi",
    "WANDB_API_KEY": "wandbKEY0123456789abcdefghijkl",
}


@pytest.fixture()
def hub_with_tokens(monkeypatch, tmp_path):
    token_file = tmp_path / "hf-home" / "token"
    token_file.parent.mkdir()
    token_file.write_text(TOKENS["login file (HF_TOKEN_PATH)"])
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", TOKENS["HF_TOKEN"])
        monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", TOKENS["HUGGING_FACE_HUB_TOKEN"])
        monkeypatch.setenv("HF_TOKEN_PATH", str(token_file))
        monkeypatch.setenv("WANDB_API_KEY", TOKENS["WANDB_API_KEY"])
        yield hub


def _leaks(blobs: dict[str, bytes]) -> list[tuple[str, str]]:
    return [(where, how) for where, blob in blobs.items() for how, token in TOKENS.items() if token.encode() in blob]


def _everything_that_went_up(hub: FakeHub) -> dict[str, bytes]:
    blobs = {f"request {index}": body for index, body in enumerate(hub.received)}
    for repo, files in hub.repos.items():
        blobs.update({f"{repo}/{path}": content for path, content in files.items()})
    return blobs


def test_no_token_set_in_any_way_reaches_the_hub_or_the_output(default_model_dir, tmp_path, hub_with_tokens, capfd):
    args = small_grpo_config(
        tmp_path / "run",
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        push_to_hub=True,
        hub_strategy="checkpoint",
        hub_model_id="tester/secret-run",
        hub_token=TOKENS["config hub_token"],
        hub_push_backoff_s=0.01,
    )
    trainer = GRPOTrainer(
        default_model_dir, exact_match_reward, args, train_dataset=addition_dataset("train", size=16), peft_config=LORA
    )
    trainer.train()
    trainer.push_to_hub(token=TOKENS["push_to_hub(token=...)"])
    files = hub_with_tokens.repos["tester/secret-run"]
    # The uploads happened: the model at the root, the arguments, and the checkpoint pushed during training.
    assert {"adapter_model.safetensors", "training_args.bin", "README.md"} <= set(files)
    assert "last-checkpoint/training_args.bin" in files and "last-checkpoint/optimizer.pt" in files
    # ... pushed once complete: trlx_scale's rollout state and the completion marker went up with it.
    assert {"last-checkpoint/rollout_state_rank0.pt", "last-checkpoint/trlx_scale_checkpoint_complete.json"} <= set(
        files
    )
    assert _leaks(_everything_that_went_up(hub_with_tokens)) == []
    # The pushed arguments still load, with everything but the secret (and the token field is there, empty).
    (tmp_path / "pushed.bin").write_bytes(files["training_args.bin"])
    loaded = torch.load(tmp_path / "pushed.bin", weights_only=False)
    assert loaded.hub_token is None and loaded.learning_rate == args.learning_rate
    assert loaded.hub_model_id == "tester/secret-run"
    # Nothing local holds it either (checkpoints can be copied off the machine), nor what the run printed, nor what
    # a tracker receives (TrainingArguments.to_dict, which masks *_token fields).
    assert files_with_secrets(str(tmp_path / "run"), TOKENS.values()) == []
    printed = capfd.readouterr()
    assert _leaks({"stdout": printed.out.encode(), "stderr": printed.err.encode()}) == []
    assert _leaks({"to_dict": repr(args.to_dict()).encode()}) == []
    assert args.hub_token == TOKENS["config hub_token"]  # the caller's config is never changed


def test_dpo_training_args_hold_no_token(default_model_dir, tmp_path, hub_with_tokens):
    args = small_dpo_config(
        tmp_path, max_steps=1, hub_model_id="tester/dpo-secret", hub_token=TOKENS["config hub_token"]
    )
    trainer = DPOTrainer(
        default_model_dir, args=args, train_dataset=addition_preference_dataset(size=16), peft_config=LORA
    )
    trainer.train()
    trainer.push_to_hub()
    assert "training_args.bin" in hub_with_tokens.repos["tester/dpo-secret"]
    assert _leaks(_everything_that_went_up(hub_with_tokens)) == []


def test_a_file_holding_a_secret_stops_the_upload_and_names_the_file(default_model_dir, tmp_path, hub_with_tokens):
    """The last look before an upload: a user's callback that wrote the token into the report is caught."""
    args = small_grpo_config(tmp_path, max_steps=1, hub_model_id="tester/leaky", hub_push_backoff_s=0.01)
    trainer = GRPOTrainer(
        default_model_dir, exact_match_reward, args, train_dataset=addition_dataset("train", size=16), peft_config=LORA
    )
    trainer.train()
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "notes.md").write_text(f"debug: token={os.environ['HF_TOKEN']}\n")
    with pytest.raises(SecretInUploadError, match=r"report/notes\.md") as raised:
        trainer.push_to_hub()
    assert TOKENS["HF_TOKEN"] not in str(raised.value)  # the error names the file, never the secret
    assert hub_with_tokens.repos.get("tester/leaky", {}) == {}  # nothing went up


def test_without_secrets_clears_every_token_field_of_a_copy(tmp_path):
    args = small_grpo_config(tmp_path, hub_token="hf_abcdefgh12345678")
    clean = without_secrets(args)
    assert clean.hub_token is None and args.hub_token == "hf_abcdefgh12345678"
    assert b"hf_abcdefgh12345678" not in pickle.dumps(clean) and b"hf_abcdefgh12345678" in pickle.dumps(args)


def test_special_token_fields_are_not_secrets(tmp_path):
    """DPOConfig's pad_token is in every tokenizer file: taken for a secret, it would block every push."""
    args = small_dpo_config(tmp_path, pad_token="<|endoftext|>", hub_token="hf_abcdefgh12345678")
    assert secret_field_names(args) == ["hub_token"]
    assert without_secrets(args).pad_token == "<|endoftext|>"
    assert "<|endoftext|>" not in known_secrets(args)


def test_a_tracker_that_would_upload_the_arguments_with_a_token_is_refused(default_model_dir, tmp_path, monkeypatch):
    """W&B's WANDB_LOG_MODEL saves the model through a plain transformers.Trainer: its training_args.bin would hold
    hub_token and go to W&B, past the Hub mixin's rewrite and scan."""
    args = small_grpo_config(tmp_path, hub_token="hf_abcdefgh12345678")
    args.report_to = ["wandb"]
    monkeypatch.setenv("WANDB_LOG_MODEL", "end")
    with pytest.raises(ValueError, match=r"WANDB_LOG_MODEL makes the wandb callback upload .* hub_token: unset"):
        GRPOTrainer(default_model_dir, exact_match_reward, args, train_dataset=addition_dataset("train", size=8))
    monkeypatch.setenv("WANDB_LOG_MODEL", "false")
    check_tracker_uploads(args)  # no model upload: nothing to refuse
    args.hub_token = None
    monkeypatch.setenv("WANDB_LOG_MODEL", "end")
    check_tracker_uploads(args)  # no token in the arguments (HF_TOKEN is never pickled)


def test_environment_secrets_are_found_by_name_and_short_values_ignored():
    found = environment_secrets(
        {
            "MY_SERVICE_API_KEY": "k" * 20,
            "S3_SECRET_ACCESS_KEY": "s" * 12,
            "GITHUB_TOKEN": "1",
            "PATH": "/usr/bin:" * 3,
        }
    )
    assert found == {"k" * 20, "s" * 12}


def test_check_folder_passes_a_clean_folder(tmp_path):
    (tmp_path / "a.txt").write_text("nothing to see")
    (tmp_path / "empty").write_bytes(b"")
    check_folder_has_no_secrets(str(tmp_path), ["hf_not_here_0123"], "a test folder")


def _bytes_read_by_this_process() -> int:
    with open("/proc/self/io") as handle:
        return int(next(line for line in handle if line.startswith("rchar:")).split()[1])


def test_the_scan_reads_each_byte_once_for_all_secrets(tmp_path):
    """Five secrets, a 12 MiB file (three scan blocks): the scan reads 12 MiB, not 60 (one pass per secret), and
    finds a secret that straddles two blocks."""
    secrets = [f"hf_secret_number_{i}_abcdefgh" for i in range(5)]
    block = 4 * 2**20
    content = bytearray(os.urandom(3 * block))
    straddling = secrets[3].encode()
    content[block - 7 : block - 7 + len(straddling)] = straddling
    path = tmp_path / "optimizer.pt"
    path.write_bytes(bytes(content))
    before = _bytes_read_by_this_process()
    assert files_with_secrets(str(tmp_path), secrets) == ["optimizer.pt"]
    read = _bytes_read_by_this_process() - before
    # found in the first two blocks (4 MiB + its successor): at most the whole file, once
    assert block <= read <= len(content) + 2**16
    path.write_bytes(os.urandom(3 * block))
    before = _bytes_read_by_this_process()
    assert files_with_secrets(str(tmp_path), secrets) == []
    assert len(content) <= _bytes_read_by_this_process() - before <= len(content) + 2**16
    assert file_holds_any(str(path), [b"x" * 3], block=16) is (b"xxx" in path.read_bytes())
