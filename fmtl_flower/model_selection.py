"""Choosing lambda by k-fold cross-validation on the training split only.

Folds are random and stratified per task (each class of each task is spread over the folds),
unlike the reference code's strided folds; the grid is the MOCHA reference code's, with 1
added: 1e-5 ... 10. The score is the mean over folds of the per-task-averaged validation error;
ties go to the smaller lambda.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .centralized import evaluate_models, fit_mocha
from .core.rng import TAG_CV
from .core.svm import fit_global_svm, fit_local_svms

LAMBDA_GRID = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
METHODS = ("mtl", "local", "global")
TaskArrays = tuple[np.ndarray, np.ndarray]


def stratified_folds(y: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Fold index (0..k-1) of every sample: each class shuffled and dealt round-robin."""
    folds = np.empty(len(y), dtype=np.int64)
    offset = 0
    for label in np.unique(y):
        idx = np.flatnonzero(y == label)
        rng.shuffle(idx)
        folds[idx] = (np.arange(len(idx)) + offset) % k
        offset += len(idx)
    return folds


def make_fitter(method: str, seed: int = 0,
                **mocha_kwargs: Any) -> Callable[[Sequence[TaskArrays], float], np.ndarray]:
    """``fit(tasks, lam) -> W`` (d x m) for ``method`` in {"mtl", "local", "global"}.

    ``mocha_kwargs`` (``rounds``, ``omega``, ...) go to :func:`fit_mocha` for ``mtl``; the
    ``local`` and ``global`` fits read only ``loss`` of them (default ``hinge``).
    """
    if method == "mtl":
        return lambda tasks, lam: fit_mocha(tasks, lam=lam, seed=seed, **mocha_kwargs).W
    loss = mocha_kwargs.get("loss", "hinge")
    if method == "local":
        return lambda tasks, lam: fit_local_svms(list(tasks), lam, seed=seed, loss=loss)
    if method == "global":
        return lambda tasks, lam: fit_global_svm(list(tasks), lam, seed=seed, loss=loss)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def cross_validate_lambda(
    method: str,
    tasks: Sequence[TaskArrays],
    *,
    grid: Sequence[float] = LAMBDA_GRID,
    folds: int = 5,
    seed: int = 0,
    **mocha_kwargs: Any,
) -> tuple[float, dict[float, float]]:
    """Pick lambda for ``method`` by ``folds``-fold CV on ``tasks`` (training data only).

    ``seed`` draws the folds and seeds the fits; ``mocha_kwargs`` configure MOCHA (``mtl``).

    Returns
    -------
    best : float
        The lambda with the lowest mean validation error (the smaller one on ties).
    scores : dict
        Mean validation error (per-task averaged, then over folds) of every lambda.
    """
    if folds < 2:
        raise ValueError(f"folds must be >= 2, got {folds}")
    fit = make_fitter(method, seed=seed, **mocha_kwargs)
    fold_of = [stratified_folds(y, folds, np.random.default_rng([seed, t, TAG_CV]))
               for t, (_, y) in enumerate(tasks)]
    scores: dict[float, float] = {}
    for lam in grid:
        errors = []
        for f in range(folds):
            train = [(X[fo != f], y[fo != f]) for (X, y), fo in zip(tasks, fold_of, strict=True)]
            valid = [(X[fo == f], y[fo == f]) for (X, y), fo in zip(tasks, fold_of, strict=True)]
            W = fit(train, lam)
            errors.append(evaluate_models(W, valid)["test_error"])
        scores[float(lam)] = float(np.mean(errors))
    best = min(scores, key=lambda lam: (scores[lam], lam))
    return best, scores
