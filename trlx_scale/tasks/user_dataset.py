"""A user's dataset, named as ``trl grpo`` names it: a Hub id, a local folder, one local file, or TRL's ``datasets``
mixture (``--config`` YAML), loaded into a ``DatasetDict`` of named splits.

One local file (``prompts.jsonl``, ``data.parquet``, ``pairs.json``, ``rows.csv``) becomes the split
``--dataset_train_split`` names, so that ``--dataset_name my_prompts.parquet`` works as a folder holding it would.
"""

from __future__ import annotations

import os

from datasets import DatasetDict, load_dataset

# Local file suffixes and the `datasets` builder that reads each.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def load_user_dataset(script_args, dataset_args=None) -> DatasetDict:
    """The dataset ``script_args.dataset_name`` (or ``dataset_args.datasets``, which wins as in ``trl grpo``) names."""
    if dataset_args is not None and dataset_args.datasets:
        from trl import get_dataset

        return get_dataset(dataset_args)
    name = script_args.dataset_name
    suffix = os.path.splitext(name)[1].lower()
    if os.path.isfile(name):
        if suffix not in FILE_BUILDERS:
            raise ValueError(
                f"--dataset_name {name}: a local file must end in one of {sorted(FILE_BUILDERS)}; pass a folder or a "
                "Hub dataset id otherwise."
            )
        return load_dataset(FILE_BUILDERS[suffix], data_files={script_args.dataset_train_split: name})
    return load_dataset(name, name=script_args.dataset_config)


def split_or_none(dataset: DatasetDict, split: str):
    """The split named ``split``, or None when the dataset has none of that name."""
    return dataset[split] if split in dataset else None
