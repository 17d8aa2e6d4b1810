"""Single-task linear SVMs (the ``local`` and ``global`` baselines), solved to a certified gap.

Objective (the MOCHA reference code's baselines, same lambda scaling as MOCHA's tasks):

    min_w  (1/n) sum_i max(0, 1 - y_i x_i^T w) + (lambda/2) |w|^2      (no intercept).

Solved by SDCA (the same compiled kernel as MOCHA's local solver, with K = lambda, so
m_tt = 1/lambda and sigma' = 1) until the duality gap is below ``tol`` relative to the
primal. Unlike scikit-learn's LinearSVC this also handles a task whose labels are all one class
(two tasks of small.mat have no positive sample).
"""

from __future__ import annotations

import numpy as np

from .hinge import hinge_conjugate_value, mean_hinge_loss
from .rng import TAG_ORDER
from .sdca import sdca_local_update


def fit_linear_svm(X: np.ndarray, y: np.ndarray, lam: float, *, tol: float = 1e-6,
                   max_epochs: int = 2000, seed: int = 0) -> tuple[np.ndarray, float]:
    """Fit the hinge-loss SVM above; return ``(w, relative duality gap)``.

    Parameters
    ----------
    X : ndarray of shape (n, d)
    y : ndarray of shape (n,), labels in {-1, +1}
    lam : float
        lambda > 0.
    tol : float
        Stop when (P - D) <= tol * max(P, 1e-12).
    max_epochs : int
        Passes over the data at most.
    seed : int
        Seed of the coordinate orders.
    """
    if not lam > 0:
        raise ValueError(f"lambda must be > 0, got {lam}")
    n, d = X.shape
    rng = np.random.default_rng([int(seed), TAG_ORDER])
    sqnorm = np.einsum("ij,ij->i", X, X)
    alpha, b = np.zeros(n), np.zeros(d)
    w = b / lam
    rel_gap = np.inf
    for _ in range(max_epochs):
        d_alpha, d_b = sdca_local_update(X, y, alpha, w, budget=n, m_tt=1.0 / lam,
                                         sigma_prime=1.0, order=rng.permutation(n),
                                         sqnorm=sqnorm)
        alpha += d_alpha
        b += d_b
        w = b / lam
        reg = 0.5 * lam * float(w @ w)
        primal = mean_hinge_loss(X, y, w) + reg
        dual = hinge_conjugate_value(alpha, y) - reg
        rel_gap = (primal - dual) / max(primal, 1e-12)
        if rel_gap <= tol:
            break
    return w, float(rel_gap)


def fit_local_svms(tasks: list[tuple[np.ndarray, np.ndarray]], lam: float,
                   **kwargs) -> np.ndarray:
    """One SVM per task; returns W of shape (d, m)."""
    return np.stack([fit_linear_svm(X, y, lam, **kwargs)[0] for X, y in tasks], axis=1)


def fit_global_svm(tasks: list[tuple[np.ndarray, np.ndarray]], lam: float,
                   **kwargs) -> np.ndarray:
    """One SVM on the pooled data (mean loss over all samples); returns W = [w .. w] (d, m)."""
    X = np.vstack([X for X, _ in tasks])
    y = np.concatenate([y for _, y in tasks])
    w, _ = fit_linear_svm(X, y, lam, **kwargs)
    return np.repeat(w[:, None], len(tasks), axis=1)
