"""Datasets for federated multi-task learning (never imports ``flwr``).

* :func:`load_dataset` / :func:`load_dataset_cached`: the entry point, by name
  (:func:`available_datasets`) or ``.mat`` path, returning a :class:`FederatedDataset`.
* :func:`load_mat_tasks`: the reference ``.mat`` files (``X``/``Y`` or ``X_ori``/``Y_ori``).
* :func:`make_synthetic_tasks`: clustered linear classification tasks.
* :func:`split_tasks` / :func:`train_test_split_task`: per-task stratified splits.
* :func:`validate_task` / :func:`check_same_dim`: validation of X and y.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fmtl_flower.data.dataset import FederatedDataset, TaskData
from fmtl_flower.data.mat import MAT_KEY_PAIRS, load_mat_tasks
from fmtl_flower.data.registry import (
    DATA_DIR_ENV,
    NAMED_FILES,
    SYNTHETIC,
    available_datasets,
    clear_dataset_cache,
    default_data_dirs,
    load_dataset,
    load_dataset_cached,
    resolve_data_file,
)
from fmtl_flower.data.split import (
    SPLIT_TAG,
    num_test_samples,
    split_tasks,
    train_test_split_task,
)
from fmtl_flower.data.synthetic import make_synthetic_tasks
from fmtl_flower.data.validation import LABEL_SETS, check_same_dim, validate_task

if TYPE_CHECKING:
    from pathlib import Path

    DEFAULT_DATA_DIRS: tuple[Path, ...]

__all__ = [
    "DATA_DIR_ENV",
    "DEFAULT_DATA_DIRS",
    "LABEL_SETS",
    "MAT_KEY_PAIRS",
    "NAMED_FILES",
    "SPLIT_TAG",
    "SYNTHETIC",
    "FederatedDataset",
    "TaskData",
    "available_datasets",
    "check_same_dim",
    "clear_dataset_cache",
    "default_data_dirs",
    "load_dataset",
    "load_dataset_cached",
    "load_mat_tasks",
    "make_synthetic_tasks",
    "num_test_samples",
    "resolve_data_file",
    "split_tasks",
    "train_test_split_task",
    "validate_task",
]


def __getattr__(name: str) -> Any:
    """Compute ``DEFAULT_DATA_DIRS`` on access (it follows ``$FMTL_DATA_DIR`` and the cwd)."""
    if name == "DEFAULT_DATA_DIRS":
        return default_data_dirs()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
