"""From a ``flwr_datasets`` partitioner to the plugin's ``load_data(context)`` loaders.

`Flower Datasets <https://flower.ai/docs/datasets/>`_ (``pip install "fmtl-flower[datasets]"``
or ``pip install flwr-datasets``) splits one Hugging Face ``datasets.Dataset`` into
partitions, IID or not (``DirichletPartitioner``, ``PathologicalPartitioner``, ...). In
federated multi-task learning a partition *is* a task: :func:`partition_loader` turns a
partitioner into the ``load_data(context)`` that :func:`~fmtl_flower.make_mocha_client_app`,
:func:`~fmtl_flower.make_fedem_client_app` and the NumPyClients take. The node's partition is
its task id (``task-id`` of the node config, else ``partition-id``: simulation sets it, a
deployed SuperNode gets ``--node-config "partition-id=3"``). Each partition is split into
train and test parts, stratified by class and seeded per partition, and relabelled for the
model:

* ``labels="pm1"`` (MOCHA, OFMTL, Mb-SGD: hinge models need {-1, +1}): labels {0, 1} become
  -1 / +1 ({-1, +1} stay); otherwise ``positive`` names the class that is +1 (one-vs-rest),
  every other class -1. The mapping never depends on which classes a partition happens to
  hold (a Dirichlet partition may hold one class only);
* ``labels="classes"`` (FedEM and its baselines): the labels as class ids 0..C-1.

Example (an in-memory dataset; nothing is downloaded)::

    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    from fmtl_flower import make_mocha_client_app, partition_loader

    partitioner = DirichletPartitioner(num_partitions=10, partition_by="label", alpha=0.5,
                                       seed=42)
    partitioner.dataset = Dataset.from_dict({"x": X.tolist(), "label": y.tolist()})
    app = make_mocha_client_app(partition_loader(partitioner, features="x", label="label"))

With ``FederatedDataset`` of ``flwr_datasets`` (a Hub dataset), pass its partitioner:
``partition_loader(fds.partitioners["train"], ...)`` after ``fds.load_partition(0)`` has
loaded it, or give any object with a ``load_partition(partition_id)`` method.

This module imports neither ``flwr`` nor ``flwr_datasets``: it reads partitions through the
partitioner's ``load_partition`` and contexts through ``node_config``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from fmtl_flower.data.split import SPLIT_TAG, train_test_split_task
from fmtl_flower.data.validation import node_task_id

__all__ = ["LABEL_MODES", "partition_arrays", "partition_loader", "relabel"]

#: ``labels`` values: {-1, +1} for the hinge models, class ids for the FedEM family.
LABEL_MODES = ("pm1", "classes")


class Partitioner(Protocol):
    """What is used of a ``flwr_datasets.partitioner.Partitioner``."""

    def load_partition(self, partition_id: int) -> Any: ...  # noqa: D102


def relabel(y: Any, labels: str, positive: Any = None, *, name: str = "partition"
            ) -> np.ndarray:
    """Labels for the model family: ``pm1`` -> float {-1, +1}, ``classes`` -> int 0..C-1.

    Parameters
    ----------
    y : array_like
        The dataset's labels (ints, or any values with an order).
    labels : {"pm1", "classes"}
    positive : optional
        ``pm1``: the label that becomes +1, every other one -1 (needed unless the labels are
        {0, 1} or {-1, +1}).
    name : str
        Prefix of error messages.
    """
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"{name}: labels must be 1-D, got shape {y.shape}")
    if labels == "classes":
        if y.size and (not np.issubdtype(y.dtype, np.number) or np.any(y < 0)
                       or np.any(y != np.round(y))):
            raise ValueError(f"{name}: labels must be class ids 0..C-1 for labels='classes'")
        return y.astype(np.int64)
    if labels != "pm1":
        raise ValueError(f"labels must be one of {LABEL_MODES}, got {labels!r}")
    if positive is not None:
        return np.where(y == positive, 1.0, -1.0)
    values = np.unique(y)
    if values.size and np.issubdtype(values.dtype, np.number) and (
            np.all(np.isin(values, (0, 1))) or np.all(np.isin(values, (-1, 1)))):
        return np.where(y > 0, 1.0, -1.0)
    raise ValueError(f"{name}: labels {values[:5].tolist()} are not {{0, 1}} or {{-1, +1}}; "
                     "with labels='pm1' pass positive=<the class that is +1> (one-vs-rest)")


def _features(partition: Any, features: str | Sequence[str], name: str) -> np.ndarray:
    columns = [features] if isinstance(features, str) else list(features)
    missing = [c for c in columns if c not in partition.column_names]
    if missing:
        raise ValueError(f"{name}: no column {missing} (columns: {partition.column_names})")
    parts = []
    for column in columns:
        values = np.asarray(partition.with_format("numpy")[column], dtype=np.float64)
        parts.append(values.reshape(len(values), -1))
    return np.hstack(parts) if len(parts) > 1 else parts[0]


def partition_arrays(partitioner: Partitioner, partition_id: int, *,
                     features: str | Sequence[str] = "x", label: str = "label",
                     labels: str = "pm1", positive: Any = None, test_frac: float = 0.25,
                     seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(X, y, X_test, y_test)`` of one partition, relabelled (see :func:`relabel`).

    Parameters
    ----------
    partitioner : flwr_datasets Partitioner
        With its ``dataset`` set (anything with ``load_partition(partition_id)`` returning a
        ``datasets.Dataset``).
    partition_id : int
    features : str or sequence of str
        A column of feature vectors, or several scalar columns (stacked in that order).
    label : str
        The label column.
    labels, positive
        See :func:`relabel`.
    test_frac : float
        Per-class fraction of the partition held out for testing, in [0, 1).
    seed : int
        Seed of the split (the stream of partition ``partition_id``).
    """
    if labels not in LABEL_MODES:
        raise ValueError(f"labels must be one of {LABEL_MODES}, got {labels!r}")
    name = f"partition {partition_id}"
    partition = partitioner.load_partition(int(partition_id))
    if label not in partition.column_names:
        raise ValueError(f"{name}: no label column {label!r} (columns: "
                         f"{partition.column_names})")
    X = _features(partition, features, name)
    y = np.asarray(partition.with_format("numpy")[label])
    if len(y) == 0:
        raise ValueError(f"{name}: empty partition (set min_partition_size, or fewer "
                         "partitions)")
    y = relabel(y, labels, positive, name=name)  # before the split: any label type
    rng = np.random.default_rng([int(seed), int(partition_id), SPLIT_TAG])
    split = train_test_split_task(X, y, test_frac, rng, name=name)
    if labels == "classes":
        return split.X_train, split.y_train.astype(np.int64), split.X_test, \
            split.y_test.astype(np.int64)
    return split.X_train, split.y_train, split.X_test, split.y_test


def _partition_of(context: Any) -> int:
    """The node's partition: ``task-id`` of the node config, else ``partition-id``."""
    return node_task_id(context.node_config,
                        "this node has no partition: simulation sets partition-id; start a "
                        "SuperNode with --node-config \"partition-id=N\"")


def partition_loader(partitioner: Partitioner, *, features: str | Sequence[str] = "x",
                     label: str = "label", labels: str = "pm1", positive: Any = None,
                     test_frac: float = 0.25, seed: int = 0
                     ) -> Callable[[Any], tuple[np.ndarray, ...]]:
    """A ``load_data(context)`` reading the node's partition of ``partitioner``.

    Arguments as :func:`partition_arrays`; the partition is the node's ``task-id``, else its
    ``partition-id``. ``labels="pm1"`` (default) for MOCHA, OFMTL and Mb-SGD,
    ``labels="classes"`` for the FedEM family.
    """
    if labels not in LABEL_MODES:
        raise ValueError(f"labels must be one of {LABEL_MODES}, got {labels!r}")

    def load_data(context: Any) -> tuple[np.ndarray, ...]:
        return partition_arrays(partitioner, _partition_of(context), features=features,
                                label=label, labels=labels, positive=positive,
                                test_frac=test_frac, seed=seed)

    return load_data
