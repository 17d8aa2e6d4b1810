"""Tests for fmtl_flower.data.synthetic."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from fmtl_flower.core.rng import TAG_SYNTHETIC_TASK
from fmtl_flower.data import load_dataset, make_synthetic_tasks
from fmtl_flower.data.synthetic import synthetic_source


def test_shapes_dtypes_labels() -> None:
    Xs, ys = make_synthetic_tasks(num_tasks=7, dim=5, samples_per_task=20, seed=3)
    assert len(Xs) == len(ys) == 7
    for X, y in zip(Xs, ys, strict=True):
        assert X.dtype == np.float64 and y.dtype == np.float64
        assert X.ndim == 2 and X.shape[1] == 5 and y.shape == (X.shape[0],)
        assert set(np.unique(y)) == {-1.0, 1.0}


def test_deterministic_from_seed() -> None:
    a = make_synthetic_tasks(num_tasks=5, seed=4)
    b = make_synthetic_tasks(num_tasks=5, seed=4)
    c = make_synthetic_tasks(num_tasks=5, seed=5)
    for xa, xb in zip(a[0] + a[1], b[0] + b[1], strict=True):
        np.testing.assert_array_equal(xa, xb)
    assert not np.array_equal(a[0][0][:5], c[0][0][:5])


def test_task_t_draws_from_its_registered_stream() -> None:
    """Task t comes from ``default_rng([seed, t, TAG_SYNTHETIC_TASK])`` (the registry's
    layout), not the old ``[seed, TAG_SYNTHETIC_TASK, t]`` that met other streams: after the
    d normals of its direction and the one of its size, its rows are the next normals."""
    dim = 4
    X, _ = synthetic_source(20, dim=dim, seed=5)(13)
    rng = np.random.default_rng([5, 13, TAG_SYNTHETIC_TASK])
    rng.standard_normal(dim)
    rng.standard_normal()
    np.testing.assert_array_equal(X, rng.standard_normal(X.shape))


def test_task_does_not_depend_on_num_tasks() -> None:
    few, _ = make_synthetic_tasks(num_tasks=3, seed=2)
    many, _ = make_synthetic_tasks(num_tasks=9, seed=2)
    for t in range(3):
        np.testing.assert_array_equal(few[t], many[t])


@pytest.mark.parametrize("seed", range(20))
def test_both_labels_in_every_task_even_when_tiny(seed: int) -> None:
    _, ys = make_synthetic_tasks(
        num_tasks=10, dim=2, samples_per_task=1, label_noise=0.0, seed=seed
    )
    for y in ys:
        assert y.size >= 10
        assert np.any(y == 1.0) and np.any(y == -1.0)


@pytest.mark.parametrize(
    "kwargs",
    [{"num_clusters": 1}, {"num_clusters": 50}, {"dim": 1}, {"task_noise": 0.0}, {"num_tasks": 1}],
)
def test_edge_arguments(kwargs: dict[str, float]) -> None:
    Xs, ys = make_synthetic_tasks(**{"num_tasks": 4, "samples_per_task": 12, **kwargs})
    assert all(np.any(y == 1.0) and np.any(y == -1.0) for y in ys)
    assert all(np.isfinite(X).all() for X in Xs)


def test_unbalanced_sizes_within_bounds() -> None:
    Xs, _ = make_synthetic_tasks(samples_per_task=60, seed=0)
    n = np.array([X.shape[0] for X in Xs])
    assert n.min() >= 15 and n.max() <= 240
    assert np.unique(n).size > 10
    assert n.max() / n.min() > 3


def test_label_noise_zero_gives_linearly_separable_tasks() -> None:
    from scipy.optimize import linprog

    Xs, ys = make_synthetic_tasks(num_tasks=3, dim=4, samples_per_task=40, label_noise=0.0)
    for X, y in zip(Xs, ys, strict=True):
        # feasible iff some w has y_i <x_i, w> >= 1 for all i (no intercept)
        res = linprog(
            np.zeros(4), A_ub=-(y[:, None] * X), b_ub=-np.ones(y.size), bounds=(None, None)
        )
        assert res.status == 0


def test_label_noise_breaks_separability() -> None:
    from scipy.optimize import linprog

    Xs, ys = make_synthetic_tasks(num_tasks=3, dim=4, samples_per_task=80, label_noise=0.2)
    for X, y in zip(Xs, ys, strict=True):
        res = linprog(
            np.zeros(4), A_ub=-(y[:, None] * X), b_ub=-np.ones(y.size), bounds=(None, None)
        )
        assert res.status == 2  # infeasible


def test_default_difficulty_global_vs_local() -> None:
    """With the defaults one pooled SVM is clearly worse than per-task SVMs."""
    from sklearn.svm import LinearSVC

    ds = load_dataset("synthetic", seed=0)

    def fit(X: np.ndarray, y: np.ndarray) -> np.ndarray:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            clf = LinearSVC(loss="hinge", fit_intercept=False, C=0.1, max_iter=20_000)
            return clf.fit(X, y).coef_.ravel()

    def error(w: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        return float(np.mean(np.sign(X @ w) != y))

    local = np.mean([error(fit(t.X_train, t.y_train), t.X_test, t.y_test) for t in ds.tasks])
    w_global = fit(*ds.pooled_train())
    glob = np.mean([error(w_global, t.X_test, t.y_test) for t in ds.tasks])
    assert glob - local >= 0.10
    assert local > 0.10  # well above the 5 % label-noise floor: room for multi-task sharing


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"num_tasks": 0}, "num_tasks"),
        ({"num_tasks": 2.0}, "num_tasks"),
        ({"num_tasks": True}, "num_tasks"),
        ({"dim": -1}, "dim"),
        ({"samples_per_task": 0}, "samples_per_task"),
        ({"num_clusters": 0}, "num_clusters"),
        ({"task_noise": -0.1}, "task_noise"),
        ({"task_noise": float("nan")}, "task_noise"),
        ({"label_noise": 0.5}, "label_noise"),
        ({"label_noise": -0.01}, "label_noise"),
        ({"label_noise": "0.1"}, "label_noise"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_argument_validation(kwargs: dict[str, object], arg: str) -> None:
    with pytest.raises(ValueError, match=f"^{arg} must be"):
        make_synthetic_tasks(**kwargs)  # type: ignore[arg-type]
