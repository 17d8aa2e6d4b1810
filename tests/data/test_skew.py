"""Tests for fmtl_flower.data.skew (MOCHA appendix E.2, Table 3) and load_dataset(skew=...)."""

from __future__ import annotations

import numpy as np
import pytest

from fmtl_flower.data import (
    load_dataset,
    load_dataset_cached,
    make_synthetic_tasks,
    skew_sizes,
    skew_tasks,
)


@pytest.mark.parametrize(
    ("m", "n_max", "n_min_paper"),
    [(30, 306, 3), (38, 581, 6), (23, 1933, 19)],  # Table 2 max -> Table 3 min (HA, GG, VS)
)
def test_table3_min_and_max_from_table2(m: int, n_max: int, n_min_paper: int) -> None:
    sizes = np.full(m, n_max)  # every task at least as large as its ladder size
    target = skew_sizes(sizes, ratio=100, seed=0)
    assert target.max() == n_max and target.min() == n_min_paper
    assert target[0] == n_max  # the largest task stays whole
    # geometric ladder: sorted targets are round(N * 100 ** (-k / (m - 1)))
    ladder = [round(n_max * 100 ** (-k / (m - 1))) for k in range(m)]
    np.testing.assert_array_equal(np.sort(target)[::-1], ladder)


def test_sizes_are_capped_and_floored() -> None:
    sizes = [300, 10, 250, 1, 2]
    target = skew_sizes(sizes, ratio=1000, seed=1, min_size=2)
    assert np.all(target <= sizes)
    assert np.all(target >= np.minimum(2, sizes))
    assert target[0] == 300
    np.testing.assert_array_equal(skew_sizes([5], ratio=100), [5])  # one task: unchanged
    np.testing.assert_array_equal(skew_sizes([7, 9, 8], ratio=1), [7, 9, 8])  # ratio 1


def test_sizes_depend_on_seed_only_through_the_order() -> None:
    sizes = [200] * 10
    a, b, c = (skew_sizes(sizes, ratio=100, seed=s) for s in (0, 0, 1))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    np.testing.assert_array_equal(np.sort(a), np.sort(c))


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"ratio": 0.5}, "finite number >= 1"),
        ({"ratio": float("inf")}, "finite number >= 1"),
        ({"ratio": True}, "number >= 1"),
        ({"ratio": "100"}, "number >= 1"),
        ({"seed": -1}, "seed"),
        ({"min_size": 0}, "min_size"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        skew_sizes([10, 20], **kwargs)  # type: ignore[arg-type]


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="no tasks"):
        skew_sizes([])
    with pytest.raises(ValueError, match=">= 1"):
        skew_sizes([3, 0])


def _tasks(sizes: list[int], pos_every: int = 5) -> tuple[list[np.ndarray], list[np.ndarray]]:
    Xs, ys = [], []
    for t, n in enumerate(sizes):
        Xs.append(np.arange(n * 2, dtype=float).reshape(n, 2) + 1000 * t)
        ys.append(np.where(np.arange(n) % pos_every == 0, 1.0, -1.0))
    return Xs, ys


def test_skew_tasks_spread_determinism_and_labels() -> None:
    sizes = [400, 380, 390, 350, 300, 399, 310, 320]
    Xs, ys = _tasks(sizes)
    X1, y1 = skew_tasks(Xs, ys, ratio=100, seed=4)
    X2, y2 = skew_tasks(Xs, ys, ratio=100, seed=4)
    got = np.array([x.shape[0] for x in X1])
    np.testing.assert_array_equal(got, skew_sizes(sizes, ratio=100, seed=4))
    assert got.max() == 400 and got.min() == 4 and got.max() / got.min() == 100
    for a, b, c, d in zip(X1, X2, y1, y2, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, d)
    for X, y, X0, y0 in zip(X1, y1, Xs, ys, strict=True):
        assert set(np.unique(y)) == {-1.0, 1.0}  # both labels kept, even with 4 samples
        # rows are original rows, in their original order, with their own labels
        idx = ((X[:, 0] - X0[0, 0]) / 2).astype(int)
        assert np.all(np.diff(idx) > 0)
        np.testing.assert_array_equal(X, X0[idx])
        np.testing.assert_array_equal(y, y0[idx])
    other, _ = skew_tasks(Xs, ys, ratio=100, seed=5)
    assert any(
        a.shape != b.shape or not np.array_equal(a, b) for a, b in zip(X1, other, strict=True)
    )
    # inputs untouched
    np.testing.assert_array_equal(Xs[0], _tasks(sizes)[0][0])


def test_skew_tasks_one_class_and_tiny_targets() -> None:
    Xs = [np.ones((50, 1)), np.ones((40, 1)), np.ones((30, 1))]
    ys = [np.ones(50), -np.ones(40), np.r_[1.0, -np.ones(29)]]
    X1, y1 = skew_tasks(Xs, ys, ratio=50, seed=0, min_size=1)
    sizes = [x.shape[0] for x in X1]
    assert sizes[0] == 50 and min(sizes) == 1
    for y in y1:
        assert set(np.unique(y)) <= {-1.0, 1.0}
    X2, y2 = skew_tasks(Xs, ys, ratio=50, seed=0, min_size=2)
    for y, y0 in zip(y2, ys, strict=True):
        assert set(np.unique(y)) == set(np.unique(y0))  # 2 samples keep both labels
    with pytest.raises(ValueError, match="2 design matrices but 3"):
        skew_tasks(Xs[:2], ys)


def test_load_dataset_skew_applies_to_training_parts() -> None:
    kw = {"num_tasks": 10, "samples_per_task": 200, "seed": 3}
    plain = load_dataset(**kw)  # type: ignore[arg-type]
    skewed = load_dataset(**kw, skew=100)  # type: ignore[arg-type]
    assert skewed.name == plain.name and skewed.num_tasks == 10
    n = skewed.n_train
    np.testing.assert_array_equal(n, skew_sizes(plain.n_train, ratio=100, seed=3))
    assert n.max() == plain.n_train.max() and n.max() / n.min() >= 50
    for a, b in zip(skewed.tasks, plain.tasks, strict=True):
        np.testing.assert_array_equal(a.X_test, b.X_test)  # test parts unchanged
        assert set(np.unique(a.y_train)) == {-1.0, 1.0}
    again = load_dataset(**kw, skew=100.0)  # type: ignore[arg-type]
    for a, b in zip(skewed.tasks, again.tasks, strict=True):
        np.testing.assert_array_equal(a.X_train, b.X_train)
    with pytest.raises(ValueError, match="skew ratio"):
        load_dataset(**kw, skew=0.5)  # type: ignore[arg-type]


def test_cached_skew_is_part_of_the_key() -> None:
    a = load_dataset_cached(num_tasks=4, skew=10)
    assert load_dataset_cached(num_tasks=4, skew=10.0) is a
    assert load_dataset_cached(num_tasks=4) is not a
    assert not a.task(0).X_train.flags.writeable


def test_skew_matches_synthetic_generator_sizes() -> None:
    Xs, ys = make_synthetic_tasks(num_tasks=6, samples_per_task=120, seed=0)
    X1, _ = skew_tasks(Xs, ys, ratio=20, seed=0)
    assert sorted(x.shape[0] for x in X1)[0] == round(max(x.shape[0] for x in Xs) / 20)


def test_skew_streams_are_not_the_budget_streams() -> None:
    """Task t's kept samples do not come from round t's budget stream (the skew's tag was
    11 = TAG_BUDGET: one Generator for both)."""
    from fmtl_flower.core.rng import TAG_BUDGET, round_rng
    from fmtl_flower.data.skew import _keep_indices, _skew_task

    seed, t, n, size = 3, 5, 400, 40
    X = np.arange(n, dtype=float).reshape(n, 1)
    y = np.where(np.arange(n) % 3 == 0, 1.0, -1.0)
    kept, _ = _skew_task(X, y, size, seed, t)
    budget_stream = _keep_indices(y, size, round_rng(seed, t, TAG_BUDGET))
    assert not np.array_equal(kept[:, 0].astype(int), budget_stream)
