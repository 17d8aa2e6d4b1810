"""Per-task stratified train/test splits.

The split is a mask over each task's samples, like the reference code's ``split_data``
(reference_algorithms.md, section 6.2): the original sample order is kept within the training
part and within the test part. Unlike the reference, it is stratified by class, so a rare
class (small.mat has 6 % positives) is represented in both parts whenever it can be.

Randomness is explicit (design decision 5): task ``t`` of a run with seed ``s`` is split with
``np.random.default_rng([s, t, 7])``, so a task's split depends on neither the other tasks
nor their number.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fmtl_flower.core.rng import TAG_SPLIT
from fmtl_flower.data.dataset import MultiTaskDataset, TaskData
from fmtl_flower.data.validation import _validate_arrays

__all__ = ["SPLIT_TAG", "split_task", "split_tasks", "num_test_samples", "train_test_split_task"]

#: Fixed tag in the per-task split seed ``[seed, task, SPLIT_TAG]`` (the registry's
#: :data:`~fmtl_flower.core.rng.TAG_SPLIT`, kept under this name).
SPLIT_TAG = TAG_SPLIT


def _check_test_frac(test_frac: float) -> float:
    """Return ``test_frac`` as a float, or raise ValueError unless it is in [0, 1)."""
    if isinstance(test_frac, bool) or not isinstance(test_frac, int | float | np.floating):
        raise ValueError(f"test_frac must be a number in [0, 1), got {test_frac!r}")
    frac = float(test_frac)
    if not 0.0 <= frac < 1.0:
        raise ValueError(f"test_frac must be in [0, 1), got {test_frac!r}")
    return frac


def _check_seed(seed: int) -> int:
    """Return ``seed`` as an int, or raise ValueError unless it is a non-negative integer."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return int(seed)


def num_test_samples(n_class: int, test_frac: float) -> int:
    """Number of test samples taken from a class with ``n_class`` samples.

    ``round(test_frac * n_class)`` (Python's ``round``, i.e. halves to even), capped at
    ``n_class - 1`` so that every class present keeps at least one training sample.

    Parameters
    ----------
    n_class : int
        Number of samples of the class in the task (>= 1).
    test_frac : float
        Fraction in [0, 1).

    Returns
    -------
    int
    """
    return max(0, min(round(test_frac * n_class), n_class - 1))


def train_test_split_task(
    X: Any,
    y: Any,
    test_frac: float,
    rng: np.random.Generator,
    *,
    name: str = "task",
) -> TaskData:
    """Split one task into train and test parts, stratified by class.

    For each distinct label with ``n_c`` samples, :func:`num_test_samples` ``(n_c, test_frac)``
    samples chosen uniformly at random (without replacement) go to the test part and the rest
    to the training part. Both parts keep the original sample order.

    Parameters
    ----------
    X : array_like
        Design matrix, shape ``(n, d)``.
    y : array_like
        Labels, shape ``(n,)`` (or a column / row vector); any label values are stratified.
    test_frac : float
        Fraction of each class that goes to the test part, in [0, 1). ``0`` gives an empty
        test part of shape ``(0, d)``.
    rng : np.random.Generator
        Source of randomness; classes are processed in increasing label order.
    name : str, default "task"
        Identifies the task in error messages.

    Returns
    -------
    TaskData
        Fresh (copied) float64 arrays.

    Raises
    ------
    ValueError
        If ``test_frac`` is not in [0, 1) or the arrays are invalid (see
        :func:`~fmtl_flower.data.validation.validate_task`; labels are not restricted here).
    TypeError
        If ``rng`` is not a ``np.random.Generator``.
    """
    frac = _check_test_frac(test_frac)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    Xa, ya = _validate_arrays(X, y, name)
    test_mask = np.zeros(ya.shape[0], dtype=bool)
    if frac > 0.0:
        for label in np.unique(ya):
            idx = np.flatnonzero(ya == label)
            k = num_test_samples(idx.size, frac)
            if k > 0:
                test_mask[rng.choice(idx, size=k, replace=False)] = True
    train_mask = ~test_mask
    return TaskData(
        X_train=Xa[train_mask],
        y_train=ya[train_mask],
        X_test=Xa[test_mask],
        y_test=ya[test_mask],
    )


def split_tasks(
    Xs: Sequence[Any],
    ys: Sequence[Any],
    test_frac: float,
    seed: int,
    name: str,
) -> MultiTaskDataset:
    """Split every task and collect the result into a :class:`MultiTaskDataset`.

    Parameters
    ----------
    Xs : sequence of array_like
        Per-task design matrices, each ``(n_t, d)``.
    ys : sequence of array_like
        Per-task labels, each of length ``n_t``.
    test_frac : float
        Per-class test fraction in [0, 1), see :func:`train_test_split_task`.
    seed : int
        Non-negative run seed; task ``t`` uses ``np.random.default_rng([seed, t, 7])``.
    name : str
        Name of the resulting dataset (also used in error messages).

    Returns
    -------
    MultiTaskDataset

    Raises
    ------
    ValueError
        If there are no tasks, ``Xs`` and ``ys`` differ in length, the seed or fraction is
        invalid, a task is invalid, or the tasks differ in ``d``.
    """
    frac = _check_test_frac(test_frac)
    seed = _check_seed(seed)
    if len(Xs) != len(ys):
        raise ValueError(f"{name}: {len(Xs)} design matrices but {len(ys)} label vectors")
    if len(Xs) == 0:
        raise ValueError(f"{name}: no tasks")
    tasks = [
        split_task(X, y, frac, seed, t, name) for t, (X, y) in enumerate(zip(Xs, ys, strict=True))
    ]
    return MultiTaskDataset(name=name, tasks=tuple(tasks))


def split_task(X: Any, y: Any, test_frac: float, seed: int, t: int, name: str) -> TaskData:
    """Split task ``t`` of the dataset ``name`` exactly as :func:`split_tasks` does.

    :func:`train_test_split_task` with ``np.random.default_rng([seed, t, SPLIT_TAG])``; used
    by :func:`split_tasks` and by the lazy datasets (:mod:`fmtl_flower.data.lazy`), which
    split one task at a time.

    Parameters
    ----------
    X, y : array_like
        The task's design matrix ``(n_t, d)`` and labels ``(n_t,)``.
    test_frac : float
        Per-class test fraction in [0, 1).
    seed : int
        Non-negative run seed.
    t : int
        Task id (>= 0).
    name : str
        Dataset name (error messages say ``"<name>: task <t>"``).

    Returns
    -------
    TaskData
    """
    rng = np.random.default_rng([seed, t, SPLIT_TAG])
    return train_test_split_task(X, y, test_frac, rng, name=f"{name}: task {t}")
