"""``push_to_hub`` that uploads only this run's files, retries server failures, and can push merged LoRA weights.

transformers uploads the whole ``output_dir`` (leftovers of earlier runs included) in one attempt. Here the model is
saved into a staging directory inside ``output_dir`` (``_hub_staging``, which transformers' own uploads ignore), with
the model card, ``run_summary.json`` and the report beside it, and that directory is uploaded. Server errors (HTTP
5xx, dropped connections) are retried ``hub_push_retries`` times with exponential backoff; then ``HubPushError``
says that everything is still saved locally and how to upload it later. Client errors (401, 403, 404) are not
retried: retrying cannot fix a token.

No secret goes up (``secrets.py``): ``training_args.bin`` is written without the config's tokens, and every staged
folder is searched for every token this process knows before it is uploaded. Checkpoint pushes during training
(``hub_strategy`` every_save / checkpoint / all_checkpoints) are staged the same way (in ``_hub_checkpoint_push-N``,
hard links where the filesystem allows) and uploaded in the background with the same retries; transformers' own
checkpoint push would pickle the whole arguments into ``output_dir`` and upload that.
"""

from __future__ import annotations

import copy
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from transformers.utils import logging

from ..reliability.sharded_checkpoint import consolidated_model_state, uses_sharded_fsdp_checkpoints
from ..trainer_part import TrainerPart
from .model_card import trlx_scale_card_section
from .secrets import check_folder_has_no_secrets, known_secrets, write_training_args

logger = logging.get_logger(__name__)

STAGING_DIRECTORY = "_hub_staging"
CHECKPOINT_STAGING_PREFIX = "_hub_checkpoint_push-"  # + step; "_*" is never uploaded from output_dir
# What a checkpoint push sends from the checkpoint (as transformers' does): the model's own files.
CHECKPOINT_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "pytorch_model.bin",
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "adapter_config.json",
    "adapter_model.bin",
    "adapter_model.safetensors",
)
# Files of output_dir that go up beside the model (the card is written into the staging directory itself).
RUN_FILES = ("run_summary.json",)
RUN_DIRECTORIES = ("report",)
T = TypeVar("T")


class HubPushError(RuntimeError):
    """The upload failed after its retries; the run's files are all still in ``output_dir``."""


def hub_endpoint() -> str:
    """``HF_ENDPOINT`` as set now (huggingface_hub reads it once, at import), else the library's endpoint."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def _retryable(error: Exception) -> bool:
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(error, HfHubHTTPError):
        status = getattr(error.response, "status_code", None)
        return status is None or status >= 500 or status == 429
    return isinstance(error, (ConnectionError, TimeoutError)) or type(error).__module__.startswith("httpx")


def with_retries(call: Callable[[], T], what: str, retries: int, backoff_s: float, sleep=time.sleep) -> T:
    """``call()``, retried ``retries`` times on server/connection errors, waiting backoff_s, 2 x backoff_s, ..."""
    for attempt in range(retries + 1):
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - classified just below
            if not _retryable(error) or attempt == retries:
                raise
            delay = backoff_s * 2**attempt
            logger.warning(
                "%s failed (%s: %s); retry %d/%d in %.1f s.",
                what,
                type(error).__name__,
                error,
                attempt + 1,
                retries,
                delay,
            )
            sleep(delay)
    raise AssertionError("unreachable")


class HubPush(TrainerPart):
    """The trainer's Hub push (``trlx_scale.trainer_features`` builds it; its overrides of transformers' Hub methods
    delegate here). Reads ``push_merged``, ``hub_push_retries`` and ``hub_push_backoff_s`` from the config (defaults
    when it is a plain TRL config)."""

    def _hub_api(self):
        from huggingface_hub import HfApi

        return HfApi(endpoint=hub_endpoint(), token=self.trainer.args.hub_token)

    def create_repo(self, token: str | None = None) -> None:
        """transformers' ``init_hf_repo``, retried."""
        if not self.trainer.is_world_process_zero():
            return
        name = self.trainer.args.hub_model_id or os.path.basename(os.path.abspath(self.trainer.args.output_dir))
        api = self._hub_api()
        repo = with_retries(
            lambda: api.create_repo(
                name,
                token=token or self.trainer.args.hub_token,
                private=self.trainer.args.hub_private_repo,
                exist_ok=True,
            ),
            f"creating the Hub repo {name}",
            self.trainer.args.hub_push_retries,
            self.trainer.args.hub_push_backoff_s,
        )
        self.trainer.hub_model_id = repo.repo_id
        self.trainer.push_in_progress = None

    def after_save(self, output_dir: str | None) -> None:
        """After transformers' ``_save``: the arguments written again, without their tokens."""
        if self.trainer.args.should_save:  # transformers' _save has just pickled the whole args, tokens included
            write_training_args(
                self.trainer.args, output_dir if output_dir is not None else self.trainer.args.output_dir
            )

    def saved_consolidated(self, output_dir: str | None, internal_call: bool) -> bool:
        """transformers' ``save_model`` for a user's call under FSDP's sharded checkpoints: the consolidated model
        (True); False leaves the save to transformers."""
        if uses_sharded_fsdp_checkpoints(self.trainer) and not internal_call:
            # transformers' save_model writes nothing under SHARDED_STATE_DICT; a user's save_model (and the Hub's)
            # gets the consolidated model, training checkpoints (internal calls) keep their per-rank shards.
            self._save_consolidated(output_dir or self.trainer.args.output_dir)
            return True
        return False

    def append_card_section(self) -> None:
        """After TRL's card (the trainer, its paper, the base model, the tags): trlx_scale's section."""
        if not self.trainer.is_world_process_zero():
            return
        path = os.path.join(self.trainer.args.output_dir, "README.md")
        if os.path.isfile(path):
            section = trlx_scale_card_section(
                self.trainer._name, self.trainer.args, self.trainer.state.log_history, self.trainer.state.global_step
            )
            with open(path, "a") as handle:
                handle.write("\n" + section)

    def push(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        **kwargs,
    ):
        self.trainer.callback_handler.on_push_begin(self.trainer.args, self.trainer.state, self.trainer.control)
        if self.trainer.hub_model_id is None:
            self.trainer.init_hf_repo(token=token)
        staging = os.path.join(self.trainer.args.output_dir, STAGING_DIRECTORY)
        if self.trainer.is_world_process_zero() and os.path.isdir(staging):
            shutil.rmtree(staging)  # a previous push's leftovers
        self.trainer.accelerator.wait_for_everyone()
        self._save_for_hub(staging)  # every rank: a sharded model is gathered collectively
        if not self.trainer.is_world_process_zero():
            return None
        kwargs.setdefault(
            "model_name", (self.trainer.args.hub_model_id or self.trainer.args.output_dir).rstrip("/").split("/")[-1]
        )
        self.trainer.create_model_card(**kwargs)
        self._stage_run_files(staging)
        check_folder_has_no_secrets(
            staging, known_secrets(self.trainer.args, token), f"to the Hub repo {self.trainer.hub_model_id}"
        )
        self.trainer._finish_current_push()  # a checkpoint push still in flight lands first
        api = self._hub_api()
        try:
            info = with_retries(
                lambda: api.upload_folder(
                    repo_id=self.trainer.hub_model_id,
                    folder_path=staging,
                    commit_message=commit_message,
                    token=token or self.trainer.args.hub_token,
                    revision=revision or self.trainer.args.hub_revision,
                ),
                f"uploading to {self.trainer.hub_model_id}",
                self.trainer.args.hub_push_retries,
                self.trainer.args.hub_push_backoff_s,
            )
        except Exception as error:
            raise HubPushError(
                f"Pushing to the Hub repo {self.trainer.hub_model_id} failed ({type(error).__name__}: {error}). Nothing is "
                f"lost: the model, its card and run_summary.json are in {self.trainer.args.output_dir} (the upload's exact "
                f"content in {staging}). Upload it later with: hf upload {self.trainer.hub_model_id} {staging}"
            ) from error
        shutil.rmtree(staging, ignore_errors=True)
        return info

    def _save_consolidated(self, output_dir: str) -> None:
        state = consolidated_model_state(self.trainer.model)  # collective: every rank; the state lands on rank 0 only
        if self.trainer.accelerator.is_main_process:
            self.trainer._save(output_dir, state_dict=state)
        self.trainer.accelerator.wait_for_everyone()

    def _save_for_hub(self, staging: str) -> None:
        if not self.trainer.args.push_merged:
            if uses_sharded_fsdp_checkpoints(self.trainer):
                self._save_consolidated(staging)
            else:
                self.trainer.save_model(staging, _internal_call=True)
            return
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        if not hasattr(model, "merge_and_unload"):
            raise ValueError(
                "push_merged=True merges a LoRA adapter into its base, but this model has no adapter: "
                "set push_merged=False (full weights are pushed as they are)."
            )
        if self.trainer.is_deepspeed_enabled or self.trainer.is_fsdp_enabled:
            raise ValueError(
                "push_merged=True needs the whole model in one process; under DeepSpeed/FSDP push the "
                "adapter (push_merged=False) and merge it where the base fits."
            )
        if self.trainer.is_world_process_zero():
            # A copy is merged: the trainer's model keeps its adapter (training or evaluation may go on).
            merged = copy.deepcopy(model).merge_and_unload()
            merged.save_pretrained(staging)
            if self.trainer.processing_class is not None:
                self.trainer.processing_class.save_pretrained(staging)
            del merged

    def _stage_run_files(self, staging: str) -> None:
        shutil.copy2(os.path.join(self.trainer.args.output_dir, "README.md"), os.path.join(staging, "README.md"))
        for name in RUN_FILES:
            path = os.path.join(self.trainer.args.output_dir, name)
            if os.path.isfile(path):
                shutil.copy2(path, os.path.join(staging, name))
        for name in RUN_DIRECTORIES:
            path = os.path.join(self.trainer.args.output_dir, name)
            if os.path.isdir(path):
                shutil.copytree(path, os.path.join(staging, name), dirs_exist_ok=True)

    # The checkpoint transformers asked to push (set on rank 0 inside _save_checkpoint), pushed once it is complete.
    _checkpoint_to_push: str | None = None
    _checkpoint_upload_thread: ThreadPoolExecutor | None = None

    def note_checkpoint(self, checkpoint_folder: str) -> None:
        """transformers calls this inside ``_save_checkpoint``, before trlx_scale's own state files, the completion
        marker and (for an asynchronous save) the shards exist: only note the folder; ``push_checkpoint``
        pushes it."""
        from transformers.trainer_utils import HubStrategy

        if self.trainer.is_world_process_zero() and self.trainer.args.hub_strategy != HubStrategy.END:
            self._checkpoint_to_push = checkpoint_folder

    def push_checkpoint(self, path: str) -> None:
        """A checkpoint push during training: staged without secrets (hard links), scanned and uploaded in the
        background, so neither a slow Hub nor the scan of a large checkpoint holds the ranks."""
        from transformers.trainer_utils import HubStrategy, SaveStrategy
        from transformers.utils.hub import PushInProgress

        if self._checkpoint_to_push != path:
            return
        self._checkpoint_to_push = None
        if (
            not self.trainer.args.hub_always_push
            and self.trainer.push_in_progress is not None
            and not self.trainer.push_in_progress.is_done()
        ):
            return  # as transformers: skip this one while the previous upload runs
        self.trainer.callback_handler.on_push_begin(self.trainer.args, self.trainer.state, self.trainer.control)
        staging = os.path.join(
            self.trainer.args.output_dir, f"{CHECKPOINT_STAGING_PREFIX}{self.trainer.state.global_step}"
        )
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        # Under FSDP's SHARDED_STATE_DICT a checkpoint holds shards, not the model files: the push carries the
        # tokenizer, the arguments and (hub_strategy checkpoint/all_checkpoints) the shards; the final push the model.
        for name in CHECKPOINT_MODEL_FILES + tuple(_weight_shards(path)):
            if os.path.isfile(os.path.join(path, name)):
                _link_or_copy(os.path.join(path, name), os.path.join(staging, name))
        if self.trainer.processing_class is not None:
            self.trainer.processing_class.save_pretrained(staging)
        write_training_args(self.trainer.args, staging)
        if self.trainer.args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
            inside = "last-checkpoint" if self.trainer.args.hub_strategy == HubStrategy.CHECKPOINT else None
            target = os.path.join(staging, inside or os.path.basename(path))
            shutil.copytree(path, target, copy_function=_link_or_copy)
        if self.trainer.args.save_strategy == SaveStrategy.STEPS:
            message = f"Training in progress, step {self.trainer.state.global_step}"
        else:
            message = f"Training in progress, epoch {int(self.trainer.state.epoch)}"
        secrets = known_secrets(self.trainer.args)
        job = self._checkpoint_uploader().submit(self._upload_staged_checkpoint, staging, message, secrets)
        if self.trainer.push_in_progress is None or self.trainer.push_in_progress.is_done():
            self.trainer.push_in_progress = PushInProgress([job])
        else:
            self.trainer.push_in_progress.jobs.append(job)

    def _checkpoint_uploader(self) -> ThreadPoolExecutor:
        # One background thread: checkpoint uploads go up in order, never two at once.
        if self._checkpoint_upload_thread is None:
            self._checkpoint_upload_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hub-checkpoint")
        return self._checkpoint_upload_thread

    def _upload_staged_checkpoint(self, staging: str, message: str, secrets: set[str]) -> None:
        api = self._hub_api()
        try:
            check_folder_has_no_secrets(staging, secrets, f"a checkpoint ({message})")
            with_retries(
                lambda: api.upload_folder(
                    repo_id=self.trainer.hub_model_id,
                    folder_path=staging,
                    commit_message=message,
                    token=self.trainer.args.hub_token,
                    revision=self.trainer.args.hub_revision,
                ),
                f"uploading a checkpoint to {self.trainer.hub_model_id}",
                self.trainer.args.hub_push_retries,
                self.trainer.args.hub_push_backoff_s,
            )
        except Exception as error:  # noqa: BLE001 - a lost checkpoint upload must not stop training
            logger.warning(
                "A checkpoint upload to %s did not happen (%s: %s); training goes on, the checkpoint is local and "
                "the final push uploads the model.",
                self.trainer.hub_model_id,
                type(error).__name__,
                error,
            )
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _weight_shards(checkpoint_folder: str) -> list[str]:
    """The shard files a sharded checkpoint's index names."""
    import json

    shards: set[str] = set()
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        path = os.path.join(checkpoint_folder, index)
        if os.path.isfile(path):
            with open(path) as handle:
                shards |= set(json.load(handle)["weight_map"].values())
    return sorted(shards)


def _link_or_copy(source: str, destination: str) -> str:
    """A hard link (no bytes copied; the file survives the checkpoint's rotation), else a copy."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)
    return destination
