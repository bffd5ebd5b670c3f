"""Resuming a DeepSpeed ZeRO checkpoint at another world size, through DeepSpeed's universal checkpoint.

DeepSpeed writes one optimizer partition per data-parallel rank (``global_step<N>/zero_pp_rank_<r>_...``), which
only the same number of ranks can load. Its universal format (``deepspeed.checkpoint.ds_to_universal``) stores each
parameter's fp32 master and moments whole, and an engine started with ``checkpoint.load_universal=True`` slices
them for its own world size. So when a run resumes from a checkpoint saved by another number of ranks, rank 0
converts it once (into ``global_step<N>_universal`` beside the original, with a ``latest_universal`` tag file; the
original is kept), the other ranks wait, and the engine is told to load the universal copy. The conversion costs a
pass over the checkpoint on rank 0; at the same world size nothing changes.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

from transformers.utils import logging

from ..atomic_files import write_text_atomically

logger = logging.get_logger(__name__)

UNIVERSAL_TAG_FILE = "latest_universal"
_OPTIMIZER_PARTITION = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def deepspeed_tag(checkpoint_dir: str) -> str | None:
    """The tag of the DeepSpeed checkpoint in ``checkpoint_dir`` (its ``latest`` file), None if there is none."""
    path = os.path.join(checkpoint_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        return handle.read().strip()


def saved_world_size(checkpoint_dir: str) -> int | None:
    """How many data-parallel ranks wrote the DeepSpeed checkpoint: its optimizer partitions, one per rank."""
    tag = deepspeed_tag(checkpoint_dir)
    if tag is None:
        return None
    names = glob.glob(os.path.join(checkpoint_dir, tag, "*_optim_states.pt"))
    ranks = {int(match.group(1)) for name in names if (match := _OPTIMIZER_PARTITION.search(os.path.basename(name)))}
    return len(ranks) or None


def convert_to_universal(checkpoint_dir: str) -> str:
    """Write the universal copy of the checkpoint's DeepSpeed state (once; a later call reuses it) and its tag file;
    returns the universal tag."""
    tag = deepspeed_tag(checkpoint_dir)
    if tag is None:
        raise ValueError(f"{checkpoint_dir} holds no DeepSpeed checkpoint (no 'latest' file): nothing to convert.")
    universal = f"{tag}_universal"
    target = os.path.join(checkpoint_dir, universal)
    if not os.path.isdir(target):  # written under a temporary name and renamed: a killed conversion is not reused
        partial = f"{target}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
        command += ["--input_folder", os.path.join(checkpoint_dir, tag), "--output_folder", partial]
        command += ["--num_extract_workers", "1", "--num_merge_workers", "1"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise RuntimeError(
                f"Converting {checkpoint_dir} to DeepSpeed's universal checkpoint (to resume it at another world "
                f"size) failed:\n{done.stderr[-3000:]}\nResume with the number of processes that saved it instead."
            )
        os.replace(partial, target)
    write_text_atomically(os.path.join(checkpoint_dir, UNIVERSAL_TAG_FILE), universal)
    return universal
