"""Tests for fmtl_flower.data.split."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmtl_flower.data import SPLIT_TAG, split_tasks, train_test_split_task
from fmtl_flower.data.split import num_test_samples


def _indexed(y: np.ndarray) -> np.ndarray:
    """A design matrix whose first column is the sample index (to track samples)."""
    n = y.shape[0]
    return np.column_stack([np.arange(n, dtype=float), np.ones(n)])


def _check_split(y: np.ndarray, test_frac: float, seed: int) -> None:
    """Assert every documented property of one task's split."""
    X = _indexed(y)
    task = train_test_split_task(X, y, test_frac, np.random.default_rng(seed))
    tr = task.X_train[:, 0].astype(int)
    te = task.X_test[:, 0].astype(int)
    # disjoint and complete
    assert np.intersect1d(tr, te).size == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([tr, te])), np.arange(y.size))
    # original order kept within each part (a mask, not a reshuffle)
    assert np.all(np.diff(tr) > 0) and np.all(np.diff(te) > 0)
    # rows and labels travel together
    np.testing.assert_array_equal(task.y_train, y[tr])
    np.testing.assert_array_equal(task.y_test, y[te])
    np.testing.assert_array_equal(task.X_test, X[te])
    assert task.X_test.shape == (te.size, 2)
    # stratification with the keep-one rule
    for label in np.unique(y):
        n_c = int(np.sum(y == label))
        expected = min(round(test_frac * n_c), n_c - 1)
        assert int(np.sum(task.y_test == label)) == expected
        assert int(np.sum(task.y_train == label)) >= 1


def test_stratified_counts() -> None:
    y = np.array([1.0] * 8 + [-1.0] * 12)
    task = train_test_split_task(_indexed(y), y, 0.25, np.random.default_rng(0))
    assert np.sum(task.y_test == 1) == 2 and np.sum(task.y_test == -1) == 3
    assert task.n_train == 15 and task.n_test == 5


def test_keep_one_train_sample_per_class() -> None:
    y = np.array([1.0, -1.0, -1.0, 3.0, 3.0, 3.0])
    task = train_test_split_task(_indexed(y), y, 0.9, np.random.default_rng(1))
    # 1 sample: round(0.9) = 1 -> capped at 0; 2 samples: round(1.8) = 2 -> 1; 3: 3 -> 2
    np.testing.assert_array_equal(np.unique(task.y_train), [-1.0, 1.0, 3.0])
    assert sorted(task.y_test.tolist()) == [-1.0, 3.0, 3.0]


def test_num_test_samples() -> None:
    assert num_test_samples(1, 0.5) == 0
    assert num_test_samples(10, 0.25) == 2  # round half to even, like Python's round
    assert num_test_samples(14, 0.25) == 4
    assert num_test_samples(100, 0.0) == 0
    assert num_test_samples(4, 0.99) == 3


def test_zero_test_frac_gives_empty_test_set() -> None:
    X = np.random.default_rng(0).standard_normal((7, 4))
    y = np.array([1, -1, 1, -1, 1, 1, 1], dtype=np.int16)
    task = train_test_split_task(X, y, 0.0, np.random.default_rng(0))
    assert task.X_test.shape == (0, 4) and task.y_test.shape == (0,)
    assert task.X_test.dtype == np.float64
    np.testing.assert_array_equal(task.X_train, X)
    np.testing.assert_array_equal(task.y_train, y.astype(float))


def test_outputs_are_fresh_arrays() -> None:
    X = np.ones((6, 2))
    y = np.array([1.0, -1.0] * 3)
    task = train_test_split_task(X, y, 0.3, np.random.default_rng(0))
    assert not np.shares_memory(task.X_train, X) and not np.shares_memory(task.y_train, y)


@pytest.mark.parametrize("frac", [1.0, 1.5, -0.1, float("nan"), "0.2", True])
def test_bad_test_frac(frac: object) -> None:
    with pytest.raises(ValueError, match="test_frac"):
        train_test_split_task(np.ones((4, 1)), [1, -1, 1, -1], frac, np.random.default_rng(0))


def test_rng_must_be_generator() -> None:
    with pytest.raises(TypeError, match="Generator"):
        train_test_split_task(np.ones((4, 1)), [1, -1, 1, -1], 0.25, 0)  # type: ignore[arg-type]


def test_invalid_arrays_named() -> None:
    with pytest.raises(ValueError, match="^ds: task 1: y has 2 labels but X has 3"):
        split_tasks([np.ones((2, 1)), np.ones((3, 1))], [[1, -1], [1, -1]], 0.25, 0, "ds")


def test_determinism_and_seed_dependence() -> None:
    rng = np.random.default_rng(5)
    Xs = [rng.standard_normal((40, 3)) for _ in range(3)]
    ys = [np.where(rng.random(40) < 0.4, 1.0, -1.0) for _ in range(3)]
    a = split_tasks(Xs, ys, 0.25, 11, "a")
    b = split_tasks(Xs, ys, 0.25, 11, "b")
    c = split_tasks(Xs, ys, 0.25, 12, "c")
    for ta, tb in zip(a.tasks, b.tasks, strict=True):
        for xa, xb in zip(ta.arrays(), tb.arrays(), strict=True):
            np.testing.assert_array_equal(xa, xb)
    assert any(
        not np.array_equal(ta.X_test, tc.X_test) for ta, tc in zip(a.tasks, c.tasks, strict=True)
    )


def test_per_task_rng_derivation_and_independence() -> None:
    rng = np.random.default_rng(3)
    Xs = [rng.standard_normal((30, 2)) for _ in range(3)]
    ys = [np.where(rng.random(30) < 0.5, 1.0, -1.0) for _ in range(3)]
    ds = split_tasks(Xs, ys, 0.3, 9, "ds")
    for t in range(3):
        direct = train_test_split_task(Xs[t], ys[t], 0.3, np.random.default_rng([9, t, SPLIT_TAG]))
        np.testing.assert_array_equal(ds.task(t).X_test, direct.X_test)
    # changing task 0 (even its size) or dropping task 2 leaves task 1's split unchanged
    other = split_tasks([Xs[0][:10], Xs[1]], [ys[0][:10], ys[1]], 0.3, 9, "other")
    np.testing.assert_array_equal(other.task(1).X_test, ds.task(1).X_test)
    np.testing.assert_array_equal(other.task(1).X_train, ds.task(1).X_train)


def test_split_tasks_errors() -> None:
    with pytest.raises(ValueError, match="2 design matrices but 1 label vectors"):
        split_tasks([np.ones((2, 1))] * 2, [[1, -1]], 0.25, 0, "ds")
    with pytest.raises(ValueError, match="no tasks"):
        split_tasks([], [], 0.25, 0, "ds")
    with pytest.raises(ValueError, match="seed"):
        split_tasks([np.ones((2, 1))], [[1, -1]], 0.25, -1, "ds")
    with pytest.raises(ValueError, match="task 1 has 2 features but task 0 has 1"):
        split_tasks([np.ones((2, 1)), np.ones((2, 2))], [[1, -1]] * 2, 0.25, 0, "ds")


@settings(max_examples=150, deadline=None)
@given(
    labels=st.lists(st.sampled_from([-1.0, 1.0, 0.0, 2.0]), min_size=1, max_size=40),
    test_frac=st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=0.99)),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_split_properties(labels: list[float], test_frac: float, seed: int) -> None:
    _check_split(np.array(labels), test_frac, seed)


@pytest.mark.parametrize("test_frac", [0.0, 0.1, 0.25, 0.5, 0.75])
def test_split_properties_unbalanced(test_frac: float) -> None:
    y = np.array([1.0] * 3 + [-1.0] * 50 + [1.0] * 2)
    for seed in range(5):
        _check_split(y, test_frac, seed)
