"""flwr_datasets partitioners as the plugin's loaders: DirichletPartitioner over an in-memory
``datasets.Dataset`` (no download) feeding MOCHA (labels relabelled to {-1, +1}) and FedEM
(class ids), with the node's partition taken from ``partition-id`` only."""

from __future__ import annotations

import logging

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
partitioners = pytest.importorskip("flwr_datasets.partitioner")

from fmtl_flower import (  # noqa: E402
    MOCHA,
    FedEM,
    make_fedem_client_app,
    make_mocha_client_app,
    partition_arrays,
    partition_loader,
)
from fmtl_flower.data.flwr_datasets import relabel  # noqa: E402
from fmtl_flower.engine import InProcessGrid  # noqa: E402

NUM_PARTITIONS = 6


@pytest.fixture(scope="module")
def dirichlet():
    """600 rows, 3 classes, Dirichlet(alpha=1) over 6 partitions; the rows as arrays."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 5))
    y = np.argmax(X[:, :3] + 0.5 * rng.normal(size=(600, 3)), axis=1)
    partitioner = partitioners.DirichletPartitioner(
        num_partitions=NUM_PARTITIONS, partition_by="label", alpha=1.0, seed=0,
        min_partition_size=20)
    partitioner.dataset = datasets.Dataset.from_dict({"x": X.tolist(), "label": y.tolist()})
    return partitioner, X, y


def rows_of(partitioner, pid: int) -> tuple[np.ndarray, np.ndarray]:
    part = partitioner.load_partition(pid).with_format("numpy")
    return np.asarray(part["x"]), np.asarray(part["label"])


def same_rows(A: np.ndarray, B: np.ndarray) -> bool:
    return sorted(map(tuple, A)) == sorted(map(tuple, B))


def test_partition_arrays_split_and_relabel(dirichlet):
    partitioner, _, _ = dirichlet
    for pid in range(NUM_PARTITIONS):
        X, y, Xt, yt = partition_arrays(partitioner, pid, features="x", label="label",
                                        positive=2, test_frac=0.25, seed=1)
        Xp, yp = rows_of(partitioner, pid)
        assert same_rows(np.vstack([X, Xt]), Xp)  # every row once, train or test
        assert len(Xt) > 0 and set(np.unique(np.concatenate([y, yt]))) <= {-1.0, 1.0}
        # a row is +1 exactly when its class is 2 (one-vs-rest, the same on every device)
        lookup = {tuple(r): c for r, c in zip(Xp, yp, strict=True)}
        assert all((lookup[tuple(r)] == 2) == (label > 0)
                   for r, label in zip(np.vstack([X, Xt]), np.concatenate([y, yt]),
                                       strict=True))
    again = partition_arrays(partitioner, 3, positive=2, seed=1)
    np.testing.assert_array_equal(again[2], partition_arrays(partitioner, 3, positive=2,
                                                             seed=1)[2])


def test_relabel_rules():
    np.testing.assert_array_equal(relabel([0, 1, 1], "pm1"), [-1.0, 1.0, 1.0])
    np.testing.assert_array_equal(relabel([0, 0], "pm1"), [-1.0, -1.0])  # one-class partition
    np.testing.assert_array_equal(relabel(["cat", "dog"], "pm1", positive="dog"), [-1.0, 1.0])
    with pytest.raises(ValueError, match="positive="):
        relabel([0, 1, 2], "pm1")
    np.testing.assert_array_equal(relabel([2, 0, 1], "classes"), [2, 0, 1])
    with pytest.raises(ValueError, match="class ids"):
        relabel([-1, 1], "classes")
    with pytest.raises(ValueError, match="labels must be one of"):
        partition_loader(None, labels="bool")


def test_mocha_federation_from_a_dirichlet_partitioner(dirichlet, caplog):
    partitioner, _, _ = dirichlet
    load = partition_loader(partitioner, features="x", label="label", positive=0, seed=2)
    app = make_mocha_client_app(load)
    grid = InProcessGrid(app, NUM_PARTITIONS)  # node configs hold partition-id only
    assert all("task-id" not in c.node_config for c in grid.contexts.values())
    strategy = MOCHA(num_tasks=NUM_PARTITIONS, lam=0.01, omega_every=5, seed=0)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.start(grid=grid, num_rounds=10, timeout=30.0)
    final = strategy.results()["final"]
    assert final["complete"] and final["gap"] >= 0
    assert final["test_error"] is not None and final["test_error"] < 0.3
    sizes = [rows_of(partitioner, p)[0].shape[0] for p in range(NUM_PARTITIONS)]
    assert strategy.n_train.tolist() == [n - _test_count(partitioner, p)
                                         for p, n in enumerate(sizes)]


def _test_count(partitioner, pid: int) -> int:
    return partition_arrays(partitioner, pid, positive=0, seed=2)[2].shape[0]


def test_fedem_federation_from_a_dirichlet_partitioner(dirichlet):
    partitioner, _, _ = dirichlet
    load = partition_loader(partitioner, labels="classes", seed=2)
    grid = InProcessGrid(make_fedem_client_app(load), NUM_PARTITIONS)
    strategy = FedEM(NUM_PARTITIONS, model="softmax", num_classes=3, num_components=2, lr=0.3,
                     batch_size=16, seed=0, discovery_timeout=5.0)
    strategy.start(grid=grid, num_rounds=5, timeout=30.0)
    final = strategy.results()["final"]
    assert final["complete"] and final["accuracy_mean"] > 1 / 3 + 0.1
