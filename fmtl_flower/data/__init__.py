"""Datasets for federated multi-task learning (never imports ``flwr``).

* :func:`load_dataset` / :func:`load_dataset_cached`: the entry point, by name
  (:func:`available_datasets`) or ``.mat`` path, returning a :class:`MultiTaskDataset`.
* :func:`load_mat_tasks`: the reference ``.mat`` files (``X``/``Y`` or ``X_ori``/``Y_ori``).
* :func:`load_har_tasks`, :func:`load_vehicle_tasks`, :func:`load_gleam_tasks`: the MOCHA
  paper's datasets from a local copy in their published layout (``"har"``, ``"vehicle"``,
  ``"gleam"`` in :func:`load_dataset`); :func:`download_dataset` fetches one into a cache, only
  when called.
* :func:`skew_tasks` / :func:`skew_sizes`: task sizes spread over two orders of magnitude
  (MOCHA appendix E.2; ``load_dataset(..., skew=100)``).
* :func:`make_synthetic_tasks`: clustered linear classification tasks.
* :func:`make_fedem_synthetic` / :func:`iter_fedem_synthetic`: FedEM's synthetic mixture
  dataset, reproduced draw for draw (``"fedem-synthetic"`` in :func:`load_dataset`).
* :func:`make_sparse_federated` / :func:`make_sparse_task`: sparse, unbalanced, non-IID nodes
  in the style of the FSVRG paper (``"sparse-federated"`` in :func:`load_dataset`, with
  ``num_tasks``, ``dim``, ``iid``), held in :class:`SparseFederatedDataset` /
  :class:`SparseTaskData` (CSR design matrices); the paper's naive predictors
  :func:`constant_error`, :func:`majority_vote_error`, :func:`linear_model_error`.
* :func:`split_tasks` / :func:`train_test_split_task`: per-task stratified splits.
* :func:`validate_task` / :func:`check_same_dim`: validation of X and y.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fmtl_flower.data.dataset import (
    LoadedTasks,
    MultiTaskDataset,
    TaskData,
    deprecated_alias,
)
from fmtl_flower.data.download import (
    SOURCES,
    DatasetSource,
    Mirror,
    download_dataset,
    locate_dataset,
)
from fmtl_flower.data.fedem_synthetic import (
    FEDEM_GENERATORS,
    FedEMSynthetic,
    FedEMSyntheticSample,
    FedEMSyntheticStream,
    FedEMSyntheticTask,
    iter_fedem_synthetic,
    make_fedem_synthetic,
)
from fmtl_flower.data.gleam import GLEAM_FEATURE_NAMES, load_gleam_tasks
from fmtl_flower.data.har import load_har_tasks
from fmtl_flower.data.mat import MAT_KEY_PAIRS, load_mat_tasks
from fmtl_flower.data.paths import CACHE_DIR_ENV, default_cache_dir
from fmtl_flower.data.registry import (
    DATA_DIR_ENV,
    FEDEM_SYNTHETIC,
    FEDEM_SYNTHETIC_SEED,
    NAMED_FILES,
    PAPER_DATASETS,
    SPARSE_FEDERATED,
    SPARSE_FEDERATED_DEFAULTS,
    SYNTHETIC,
    available_datasets,
    clear_dataset_cache,
    default_data_dirs,
    load_dataset,
    load_dataset_cached,
    resolve_data_file,
)
from fmtl_flower.data.skew import skew_dataset, skew_sizes, skew_tasks
from fmtl_flower.data.sparse_federated import (
    SPARSE_DEFAULTS,
    SparseFederatedDataset,
    SparseTaskData,
    constant_error,
    linear_model_error,
    majority_vote_error,
    make_sparse_federated,
    make_sparse_task,
)
from fmtl_flower.data.split import (
    SPLIT_TAG,
    num_test_samples,
    split_tasks,
    train_test_split_task,
)
from fmtl_flower.data.synthetic import make_synthetic_tasks
from fmtl_flower.data.validation import LABEL_SETS, check_same_dim, validate_task
from fmtl_flower.data.vehicle import load_vehicle_tasks

if TYPE_CHECKING:
    from pathlib import Path

    DEFAULT_DATA_DIRS: tuple[Path, ...]

__all__ = [
    "CACHE_DIR_ENV",
    "DATA_DIR_ENV",
    "DEFAULT_DATA_DIRS",
    "FEDEM_GENERATORS",
    "FEDEM_SYNTHETIC",
    "FEDEM_SYNTHETIC_SEED",
    "GLEAM_FEATURE_NAMES",
    "LABEL_SETS",
    "MAT_KEY_PAIRS",
    "NAMED_FILES",
    "PAPER_DATASETS",
    "SOURCES",
    "SPARSE_DEFAULTS",
    "SPARSE_FEDERATED",
    "SPARSE_FEDERATED_DEFAULTS",
    "SPLIT_TAG",
    "SYNTHETIC",
    "DatasetSource",
    "FedEMSynthetic",
    "FedEMSyntheticSample",
    "FedEMSyntheticStream",
    "FedEMSyntheticTask",
    "LoadedTasks",
    "Mirror",
    "MultiTaskDataset",
    "SparseFederatedDataset",
    "SparseTaskData",
    "TaskData",
    "available_datasets",
    "check_same_dim",
    "clear_dataset_cache",
    "constant_error",
    "default_cache_dir",
    "default_data_dirs",
    "download_dataset",
    "iter_fedem_synthetic",
    "linear_model_error",
    "load_dataset",
    "load_dataset_cached",
    "load_gleam_tasks",
    "load_har_tasks",
    "load_mat_tasks",
    "load_vehicle_tasks",
    "locate_dataset",
    "majority_vote_error",
    "make_fedem_synthetic",
    "make_sparse_federated",
    "make_sparse_task",
    "make_synthetic_tasks",
    "num_test_samples",
    "resolve_data_file",
    "skew_dataset",
    "skew_sizes",
    "skew_tasks",
    "split_tasks",
    "train_test_split_task",
    "validate_task",
]


def __getattr__(name: str) -> Any:
    """Compute ``DEFAULT_DATA_DIRS`` on access (it follows ``$FMTL_DATA_DIR`` and the cwd);
    the deprecated ``FederatedDataset`` (now :class:`MultiTaskDataset`) with a warning."""
    if name == "DEFAULT_DATA_DIRS":
        return default_data_dirs()
    return deprecated_alias(__name__, name, globals())
