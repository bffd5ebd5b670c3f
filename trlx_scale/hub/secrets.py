"""No secret in any byte that leaves the machine.

transformers pickles the whole ``TrainingArguments`` into ``training_args.bin`` beside every saved model and
checkpoint, and uploads that file with the model (``push_to_hub``, and each checkpoint push of ``hub_strategy``).
Its JSON form (``to_dict``, which trackers and logs use) masks the ``*_token`` fields; the pickle does not, so a run
started with ``hub_token=...`` published the token to everyone who can read the model repo.

Two defences, both here:

1. ``without_secrets(args)``: a copy of the arguments whose secret fields are cleared; the trainers rewrite every
   ``training_args.bin`` transformers saves from it (``HubPush.after_save``) right after transformers wrote it, and
   stage checkpoint pushes themselves, so no file that is uploaded holds them.
2. ``check_folder_has_no_secrets(folder, secrets)``: the last look before an upload. Every byte of every file that is
   about to go up is searched (read once, for all secrets together) for every secret this process knows (the config's token fields, the token of an
   explicit ``push_to_hub(token=...)``, tokens in the environment, the token huggingface_hub stored at login); a hit
   stops the upload with an error that names the file (never the secret). A user's own callback or reward function
   that writes a token into ``output_dir`` is caught here too.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Iterable
from typing import Any

from ..atomic_files import replace_atomically
from ..progress_notice import PeriodicNotice

TRAINING_ARGS_NAME = "training_args.bin"  # transformers.trainer.TRAINING_ARGS_NAME (pinned by a contract test)
# Environment variables that hold credentials by name. Any variable whose name ends like this is treated as one.
SECRET_NAME = re.compile(r"(TOKEN|API_KEY|ACCESS_KEY|SECRET|SECRET_KEY|PASSWORD)$", re.IGNORECASE)
# Shorter values are not searched for: "1", "true" or a port number would match everywhere and protect nothing.
MIN_SECRET_LENGTH = 8


class SecretInUploadError(RuntimeError):
    """A file about to be uploaded holds a secret; nothing was uploaded."""


# ``*_token`` fields that name a tokenizer's special token, not a credential (TRL's DPOConfig has pad_token; SFT and
# reward configs eos_token): their values are in every tokenizer file, and they must stay in the arguments.
SPECIAL_TOKEN_FIELDS = frozenset(
    {"pad_token", "eos_token", "bos_token", "unk_token", "sep_token", "cls_token", "mask_token"}
)


def secret_field_names(args: Any) -> list[str]:
    """The config's fields that hold credentials: the ``*_token`` fields (``hub_token``, and any a subclass or a
    later version adds; transformers masks them all in ``to_dict``) except the tokenizer's special tokens."""
    if not dataclasses.is_dataclass(args):
        return []
    return [
        f.name for f in dataclasses.fields(args) if f.name.endswith("_token") and f.name not in SPECIAL_TOKEN_FIELDS
    ]


def without_secrets(args: Any) -> Any:
    """A shallow copy of ``args`` with every secret field set to None (the caller's object is not touched; no
    ``__post_init__`` runs again)."""
    clean = copy.copy(args)
    for name in secret_field_names(args):
        setattr(clean, name, None)
    return clean


# transformers' tracker callbacks that upload the saved model when these are set: they save it through a plain
# transformers.Trainer, whose training_args.bin holds the whole arguments, tokens included.
MODEL_UPLOADING_TRACKERS = {"wandb": "WANDB_LOG_MODEL", "dvclive": "HF_DVCLIVE_LOG_MODEL"}


def check_tracker_uploads(args: Any) -> None:
    """Refuse a tracker that would upload ``training_args.bin`` with a token in it (W&B's ``WANDB_LOG_MODEL``,
    DVCLive's ``HF_DVCLIVE_LOG_MODEL``, with a config ``*_token`` field set)."""
    tokens = [name for name in secret_field_names(args) if getattr(args, name, None)]
    report_to = getattr(args, "report_to", None) or []
    report_to = [report_to] if isinstance(report_to, str) else list(report_to)
    for tracker, variable in MODEL_UPLOADING_TRACKERS.items():
        uploads = os.environ.get(variable, "false").strip().lower() not in ("", "false", "0", "no")
        if tokens and uploads and (tracker in report_to or "all" in report_to):
            raise ValueError(
                f"{variable} makes the {tracker} callback upload the saved model with a training_args.bin that holds "
                f"{', '.join(tokens)}: unset {tokens[0]} (huggingface_hub reads HF_TOKEN or the `hf auth login` file "
                f"instead) or unset {variable}."
            )


def environment_secrets(environ: dict[str, str] | None = None) -> set[str]:
    """Values of the environment's credential variables (HF_TOKEN, HUGGING_FACE_HUB_TOKEN, WANDB_API_KEY, ...)."""
    environ = os.environ if environ is None else environ
    return {value for name, value in environ.items() if SECRET_NAME.search(name) and len(value) >= MIN_SECRET_LENGTH}


def stored_hub_tokens() -> set[str]:
    """Tokens huggingface_hub would use when none is given: HF_TOKEN (via ``get_token``) and the login file
    (``hf auth login`` writes it; HF_TOKEN_PATH moves it; read here even when HF_TOKEN wins over it)."""
    found: set[str] = set()
    try:
        from huggingface_hub import constants, get_token

        token = get_token()
        found |= {token} if token else set()
        path = os.environ.get("HF_TOKEN_PATH", constants.HF_TOKEN_PATH)
        if os.path.isfile(path):
            with open(path) as handle:
                found |= {handle.read().strip()}
    except Exception:  # noqa: BLE001 - an unreadable token file is no secret to protect
        pass
    return found


def known_secrets(args: Any, *extra: str | None) -> set[str]:
    """Every secret this process knows: the config's token fields, ``extra`` (e.g. ``push_to_hub(token=...)``), the
    environment's credential variables and huggingface_hub's stored token."""
    values = [getattr(args, name, None) for name in secret_field_names(args)]
    values += [*extra, *stored_hub_tokens()]
    found = {value for value in values if isinstance(value, str) and len(value) >= MIN_SECRET_LENGTH}
    return found | environment_secrets()


# Files are read in blocks this large, and every secret is searched for in a block while it is in the cache: the
# bytes are read once for all secrets (a search per secret over a mapped file read a 70B checkpoint once per
# secret: 5 secrets, 5 reads of 140 GB).
_SCAN_BLOCK = 4 * 2**20


def file_holds_any(path: str, needles: list[bytes], block: int = _SCAN_BLOCK) -> bool:
    """Whether the file at ``path`` contains any of ``needles``, reading its bytes once: each block, with the last
    ``len(longest needle) - 1`` bytes of the one before it (a secret split across two blocks), is searched for every
    needle."""
    overlap = max(len(needle) for needle in needles) - 1
    tail = b""
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            window = tail + chunk
            if any(needle in window for needle in needles):
                return True
            tail = window[-overlap:] if overlap else b""
    return False


def files_with_secrets(folder: str, secrets: Iterable[str], progress: PeriodicNotice | None = None) -> list[str]:
    """Paths (relative to ``folder``) of the files under it whose bytes contain any of ``secrets``; a large folder
    says how far the scan is every few seconds (``progress``)."""
    needles = [secret.encode() for secret in secrets if secret]
    if not needles:
        return []
    progress = progress or PeriodicNotice(f"secret scan of {folder} before the upload")
    hits, scanned = [], 0
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) == 0:
                continue
            if file_holds_any(path, needles):
                hits.append(os.path.relpath(path, folder))
            scanned += 1
            progress.tick(lambda elapsed, scanned=scanned: f"{scanned} files scanned in {elapsed:.0f} s")
    return sorted(hits)


def check_folder_has_no_secrets(folder: str, secrets: Iterable[str], what: str) -> None:
    """Refuse to upload ``folder`` when a file in it holds a secret (the message names the files, not the secret)."""
    hits = files_with_secrets(folder, secrets)
    if hits:
        raise SecretInUploadError(
            f"Not uploading {what}: {', '.join(hits)} in {folder} contain(s) a token or key of this process (a "
            "config *_token field, push_to_hub(token=...), an environment variable such as HF_TOKEN, or the stored "
            "Hub login). Nothing was uploaded. Remove the secret from those files (a callback or reward function "
            "that writes it?) and push again."
        )


def write_training_args(args: Any, output_dir: str) -> None:
    """``training_args.bin`` as transformers writes it (``torch.save`` of the arguments), without the secrets."""
    import torch

    replace_atomically(
        os.path.join(output_dir, TRAINING_ARGS_NAME), lambda path: torch.save(without_secrets(args), path)
    )
