"""Highly skewed task sizes (MOCHA appendix E.2, Table 3).

MOCHA: "To generate highly skewed data, we sample from the original training datasets so that
the task dataset sizes differ by at least two orders of magnitude." Its Table 3 keeps the
largest training set whole (HA-Skew / GG-Skew / VS-Skew max 306 / 581 / 1,933, the Table 2
maxima) and shrinks the smallest to 3 / 6 / 19 = round(max / 100).

How sizes are drawn here (:func:`skew_sizes`), for tasks of sizes ``n_0 .. n_{m-1}``,
``N = max n_t`` and a ``ratio`` (default 100):

1. a geometric ladder of ``m`` sizes from ``N`` down to ``N / ratio``:
   ``s_k = round(N * ratio ** (-k / (m - 1)))``, ``k = 0 .. m-1`` (``s_0 = N``);
2. the largest task (the first one if several tie) gets ``s_0``, i.e. stays whole; the other
   tasks get ``s_1 .. s_{m-1}`` in a random order (a permutation drawn from
   ``np.random.default_rng([seed, 61])``);
3. each size is then clipped to ``[min(min_size, n_t), n_t]`` (a task cannot grow).

So, with ``min_size <= N / ratio`` and tasks at least as large as their ladder size (as in
the paper's data), the largest size is ``N`` and the smallest ``round(N / ratio)``: Table 3's
min and max are reproduced exactly from Table 2's maxima.

Which samples are kept (:func:`skew_tasks`): for task ``t`` with target ``s < n_t``, using
``np.random.default_rng([seed, t, 61])``: one sample of each class first (so that a task keeps
both labels whenever ``s`` is at least its number of classes), in increasing label order, then
``s - (number of classes)`` more uniformly without replacement from the rest; the kept samples
stay in their original order. A task with ``s = n_t`` is returned unchanged.

In :func:`~fmtl_flower.data.registry.load_dataset`, ``skew=ratio`` applies this to each task's
*training* part after the usual split (the paper samples "from the original training
datasets"); test parts are untouched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fmtl_flower.core.rng import TAG_SKEW
from fmtl_flower.data.dataset import MultiTaskDataset, TaskData
from fmtl_flower.data.split import _check_seed
from fmtl_flower.data.validation import _validate_arrays

__all__ = ["SKEW_TAG", "check_skew_ratio", "skew_dataset", "skew_sizes", "skew_tasks"]

#: Fixed tag in the skew seeds ``[seed, SKEW_TAG]`` and ``[seed, t, SKEW_TAG]`` (the registry's
#: :data:`~fmtl_flower.core.rng.TAG_SKEW`, 61; it was 11, the systems budgets' tag).
SKEW_TAG = TAG_SKEW


def check_skew_ratio(ratio: Any) -> float:
    """Return ``ratio`` as a float, or raise ValueError unless it is a finite number >= 1."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float | np.integer | np.floating):
        raise ValueError(f"skew ratio must be a number >= 1, got {ratio!r}")
    r = float(ratio)
    if not (math.isfinite(r) and r >= 1.0):
        raise ValueError(f"skew ratio must be a finite number >= 1, got {ratio!r}")
    return r


def _check_min_size(min_size: Any) -> int:
    if isinstance(min_size, bool) or not isinstance(min_size, int | np.integer) or min_size < 1:
        raise ValueError(f"min_size must be a positive int, got {min_size!r}")
    return int(min_size)


def skew_sizes(
    sizes: Sequence[int], *, ratio: float = 100.0, seed: int = 0, min_size: int = 2
) -> np.ndarray:
    """Target task sizes spread over ``ratio`` (see the module docstring for the exact rule).

    Parameters
    ----------
    sizes : sequence of int
        Current task sizes ``n_t`` (each >= 1).
    ratio : float, default 100.0
        Largest over smallest ladder size (>= 1; 1 keeps every task whole).
    seed : int, default 0
        Non-negative seed of the permutation.
    min_size : int, default 2
        Floor for every target (capped at ``n_t``), so that small tasks keep both labels.

    Returns
    -------
    np.ndarray
        int64 targets, ``min(min_size, n_t) <= target_t <= n_t``.

    Raises
    ------
    ValueError
        Empty ``sizes``, a size < 1, or an invalid ``ratio`` / ``seed`` / ``min_size``.
    """
    r = check_skew_ratio(ratio)
    seed = _check_seed(seed)
    floor = _check_min_size(min_size)
    n = np.asarray(sizes, dtype=np.int64).reshape(-1)
    if n.size == 0:
        raise ValueError("skew_sizes: no tasks")
    if (n < 1).any():
        raise ValueError(f"skew_sizes: task sizes must be >= 1, got {n.tolist()}")
    m = n.size
    big = int(np.argmax(n))
    N = int(n[big])
    ladder = [round(N * r ** (-k / (m - 1))) for k in range(m)] if m > 1 else [N]
    order = np.random.default_rng([seed, SKEW_TAG]).permutation(m - 1)
    targets = np.empty(m, dtype=np.int64)
    targets[big] = ladder[0]
    others = [t for t in range(m) if t != big]
    for t, k in zip(others, order, strict=True):
        targets[t] = ladder[1 + int(k)]
    return np.minimum(n, np.maximum(targets, np.minimum(floor, n)))


def _keep_indices(y: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of ``size`` samples: one per class first, then uniform from the rest."""
    n = y.shape[0]
    if size >= n:
        return np.arange(n)
    classes = np.unique(y)
    chosen: list[int] = []
    if size >= classes.size:
        chosen = [int(rng.choice(np.flatnonzero(y == c))) for c in classes]
    rest = np.setdiff1d(np.arange(n), chosen, assume_unique=False)
    extra = rng.choice(rest, size=size - len(chosen), replace=False)
    return np.sort(np.concatenate([np.asarray(chosen, dtype=np.int64), extra.astype(np.int64)]))


def _skew_task(
    X: np.ndarray, y: np.ndarray, size: int, seed: int, t: int
) -> tuple[np.ndarray, np.ndarray]:
    """Task ``t``'s kept ``size`` samples (:func:`_keep_indices` with
    ``default_rng([seed, t, SKEW_TAG])``), as fresh arrays in their original order; shared by
    :func:`skew_tasks` and the lazy :class:`~fmtl_flower.data.lazy.SkewSource`, so that both
    keep the same samples."""
    idx = _keep_indices(y, int(size), np.random.default_rng([seed, t, SKEW_TAG]))
    return X[idx].copy(), y[idx].copy()


def skew_tasks(
    Xs: Sequence[Any],
    ys: Sequence[Any],
    *,
    ratio: float = 100.0,
    seed: int = 0,
    min_size: int = 2,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Subsample tasks so that their sizes differ by about ``ratio`` (pure, seeded).

    Sizes come from :func:`skew_sizes`; the samples kept are chosen as the module docstring
    says. The inputs are not modified.

    Parameters
    ----------
    Xs : sequence of array_like
        Per-task design matrices, each ``(n_t, d)``.
    ys : sequence of array_like
        Per-task labels, each ``(n_t,)`` (any values; one of each class is kept first).
    ratio, seed, min_size
        As for :func:`skew_sizes`.

    Returns
    -------
    Xs : list of np.ndarray
        Subsampled float64 design matrices (fresh arrays), original row order kept.
    ys : list of np.ndarray
        Matching float64 labels.

    Raises
    ------
    ValueError
        ``Xs`` and ``ys`` of different lengths, no tasks, an invalid task, or invalid
        ``ratio`` / ``seed`` / ``min_size``.
    """
    if len(Xs) != len(ys):
        raise ValueError(f"skew_tasks: {len(Xs)} design matrices but {len(ys)} label vectors")
    arrays = [
        _validate_arrays(X, y, f"skew_tasks: task {t}")
        for t, (X, y) in enumerate(zip(Xs, ys, strict=True))
    ]
    targets = skew_sizes([y.shape[0] for _, y in arrays], ratio=ratio, seed=seed, min_size=min_size)
    out_X, out_y = [], []
    for t, ((X, y), size) in enumerate(zip(arrays, targets, strict=True)):
        X_kept, y_kept = _skew_task(X, y, size, seed, t)
        out_X.append(X_kept)
        out_y.append(y_kept)
    return out_X, out_y


def skew_dataset(
    dataset: MultiTaskDataset, *, ratio: float = 100.0, seed: int = 0, min_size: int = 2
) -> MultiTaskDataset:
    """Skew the training parts of a dataset with :func:`skew_tasks`; test parts unchanged.

    Parameters
    ----------
    dataset : MultiTaskDataset
        Split dataset.
    ratio, seed, min_size
        As for :func:`skew_sizes`.

    Returns
    -------
    MultiTaskDataset
        Same name and task order, new training arrays, the same test arrays.
    """
    Xs, ys = skew_tasks(
        [t.X_train for t in dataset.tasks],
        [t.y_train for t in dataset.tasks],
        ratio=ratio,
        seed=seed,
        min_size=min_size,
    )
    tasks = [
        TaskData(X_train=X, y_train=y, X_test=t.X_test, y_test=t.y_test)
        for X, y, t in zip(Xs, ys, dataset.tasks, strict=True)
    ]
    return MultiTaskDataset(name=dataset.name, tasks=tuple(tasks))
