"""Tests for fmtl_flower.data.dataset."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fmtl_flower.data import MultiTaskDataset, TaskData


def _task(n_train: int, n_test: int, d: int = 3, offset: float = 0.0) -> TaskData:
    Xtr = np.arange(n_train * d, dtype=float).reshape(n_train, d) + offset
    Xte = -np.ones((n_test, d))
    return TaskData(Xtr, np.ones(n_train), Xte, -np.ones(n_test))


def test_task_data_properties() -> None:
    t = _task(5, 2, d=4)
    assert (t.n_train, t.n_test, t.dim) == (5, 2, 4)
    empty = _task(3, 0)
    assert empty.n_test == 0 and empty.X_test.shape == (0, 3)


def test_task_data_is_frozen() -> None:
    t = _task(2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.X_train = np.zeros((1, 3))  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"X_train": np.ones(3)}, "X_train must be 2-D"),
        ({"y_train": np.ones((2, 1))}, "y_train must be 1-D"),
        ({"y_train": np.ones(3)}, "X_train has 2 rows but y_train has 3"),
        ({"X_test": np.ones((1, 4))}, "X_train has 3 features but X_test has 4"),
    ],
)
def test_task_data_shape_errors(kwargs: dict[str, np.ndarray], pattern: str) -> None:
    base = {
        "X_train": np.ones((2, 3)),
        "y_train": np.ones(2),
        "X_test": np.ones((1, 3)),
        "y_test": np.ones(1),
    }
    base.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        TaskData(**base)


def test_federated_dataset_properties() -> None:
    ds = MultiTaskDataset("toy", [_task(4, 1), _task(2, 0, offset=100.0), _task(7, 3)])
    assert isinstance(ds.tasks, tuple)
    assert ds.num_tasks == 3 and ds.dim == 3
    assert ds.n_train.dtype == np.int64
    np.testing.assert_array_equal(ds.n_train, [4, 2, 7])
    np.testing.assert_array_equal(ds.n_test, [1, 0, 3])
    assert ds.task(1) is ds.tasks[1]
    assert ds.task(np.int64(2)) is ds.tasks[2]


def test_pooled_train_stacks_in_task_order() -> None:
    tasks = [_task(4, 1), _task(2, 0, offset=100.0)]
    X, y = MultiTaskDataset("toy", tasks).pooled_train()
    assert X.shape == (6, 3) and y.shape == (6,)
    np.testing.assert_array_equal(X[:4], tasks[0].X_train)
    np.testing.assert_array_equal(X[4:], tasks[1].X_train)
    Xt, yt = MultiTaskDataset("toy", tasks).pooled_test()
    assert Xt.shape == (1, 3) and yt.shape == (1,)


@pytest.mark.parametrize("t", [3, 10, -1])
def test_task_index_out_of_range(t: int) -> None:
    ds = MultiTaskDataset("toy", [_task(2, 1)] * 3)
    with pytest.raises(IndexError, match=r"task id .* out of range; valid ids are 0\.\.2"):
        ds.task(t)


def test_task_index_type() -> None:
    ds = MultiTaskDataset("toy", [_task(2, 1)])
    with pytest.raises(TypeError):
        ds.task(0.0)  # type: ignore[arg-type]


def test_federated_dataset_errors() -> None:
    with pytest.raises(ValueError, match="no tasks"):
        MultiTaskDataset("toy", ())
    with pytest.raises(ValueError, match="task 1 has 2 features but task 0 has 3"):
        MultiTaskDataset("toy", [_task(2, 1), _task(2, 1, d=2)])
    with pytest.raises(TypeError, match="task 0 is tuple"):
        MultiTaskDataset("toy", [(np.ones((1, 1)), np.ones(1))])  # type: ignore[list-item]


def test_old_container_name_is_a_deprecated_alias():
    import fmtl_flower.data as data_pkg
    from fmtl_flower.data import dataset as dataset_module

    for module in (data_pkg, dataset_module):
        with pytest.warns(DeprecationWarning, match="MultiTaskDataset"):
            assert module.FederatedDataset is MultiTaskDataset
    with pytest.raises(AttributeError, match="NoSuchThing"):
        dataset_module.NoSuchThing  # noqa: B018
