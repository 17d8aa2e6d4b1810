"""Single-task linear SVMs (the ``local`` and ``global`` baselines), solved to a certified gap.

One SVM solves (no intercept, as in the MOCHA reference code)

    min_w  (1/n) sum_i max(0, 1 - y_i x_i^T w) + (c/2) |w|^2.

The baselines use MOCHA's lambda scaling: with m tasks, c = lambda * m, which is exactly the
per-task regularisation of MOCHA's ``identity`` formulation (K = lambda m I, where MOCHA also
starts). So a lambda means the same for all three methods, ``local`` equals MOCHA with Omega
fixed at m I, and one grid of lambdas covers the same range for each.

Solved by SDCA (the same kernel as MOCHA's local solver, with K = c, so m_tt = 1/c and
sigma' = 1; whole epochs run compiled, or as Python over the numpy SDCA steps when the work
is small or numba missing, :mod:`fmtl_flower.core.jit`) until the duality gap is below
``tol`` relative to the primal. Unlike scikit-learn's LinearSVC this also handles a task
whose labels are all one class (two tasks of small.mat have no positive sample).
"""

from __future__ import annotations

import numpy as np

from .jit import kernel, steps_work
from .losses import HINGE, Loss, compiled_loss_call, dual_value, get_loss, loss_value
from .rng import TAG_ORDER, _permutation
from .sdca import _sdca_kernel


@kernel(work=lambda X, y, lam, tol, max_epochs, *_: steps_work(max_epochs * X.shape[0],
                                                               X.shape[1]),
        compiles=compiled_loss_call)
def _svm_sdca(X, y, lam, tol, max_epochs, check_every, seed, loss):  # pragma: no cover - compiled
    n, d = X.shape
    sqnorm = np.empty(n)
    for i in range(n):
        sqnorm[i] = X[i] @ X[i]
    alpha = np.zeros(n)
    w = np.zeros(d)
    zero = np.zeros(n)
    rel_gap = np.inf
    scale = 1.0 / lam
    for epoch in range(1, max_epochs + 1):
        order = _permutation(np.uint64(seed), np.uint64(epoch), np.uint64(0),
                             np.uint64(TAG_ORDER), n)
        # steps on alpha itself: d_alpha accumulates into alpha, v = w + b_change / lam = w(alpha)
        _sdca_kernel(X, y, zero, sqnorm, w, order, n, scale, alpha, w, loss)
        if epoch % check_every != 0 and epoch != max_epochs:
            continue
        total = 0.0
        dual = 0.0
        for i in range(n):
            margin = y[i] * (X[i] @ w)
            if loss != HINGE:
                total += loss_value(loss, margin)
                dual += dual_value(loss, y[i] * alpha[i])
                continue
            if margin < 1.0:
                total += 1.0 - margin
            dual += y[i] * alpha[i]
        reg = 0.5 * lam * (w @ w)
        primal = total / n + reg
        rel_gap = (primal - (dual / n - reg)) / max(primal, 1e-12)
        if rel_gap <= tol:
            break
    return w, rel_gap


def fit_linear_svm(X: np.ndarray, y: np.ndarray, c: float, *, tol: float = 1e-5,
                   max_epochs: int = 1000, seed: int = 0, check_every: int = 5,
                   loss: str | Loss = "hinge") -> tuple[np.ndarray, float]:
    """Fit the hinge-loss SVM above (or the same problem with another loss of
    :mod:`fmtl_flower.core.losses`); return ``(w, relative duality gap)``.

    Parameters
    ----------
    X : ndarray of shape (n, d)
    y : ndarray of shape (n,), labels in {-1, +1}
    c : float
        Regularisation strength c > 0.
    tol : float
        Stop when (P - D) <= tol * P (a certificate: P is then within tol of the optimum).
    max_epochs : int
        Passes over the data at most.
    seed : int
        Seed of the coordinate orders (one permutation per epoch).
    check_every : int
        Epochs between duality-gap checks.
    loss : str or Loss, default "hinge"
        The loss l of ``(1/n) sum_i l(y_i x_i^T w) + (c/2) |w|^2``.
    """
    code = get_loss(loss).code
    if not c > 0:
        raise ValueError(f"c must be > 0, got {c}")
    if max_epochs < 1 or check_every < 1:
        raise ValueError("max_epochs and check_every must be >= 1")
    X = np.ascontiguousarray(X, dtype=np.float64)
    y = np.ascontiguousarray(y, dtype=np.float64)
    w, rel_gap = _svm_sdca(X, y, float(c), float(tol), int(max_epochs), int(check_every),
                           int(seed) & ((1 << 63) - 1), code)
    return w, float(rel_gap)


def fit_local_svms(tasks: list[tuple[np.ndarray, np.ndarray]], lam: float,
                   **kwargs) -> np.ndarray:
    """One SVM per task with c = lambda * m; returns W of shape (d, m)."""
    c = lam * len(tasks)
    return np.stack([fit_linear_svm(X, y, c, **kwargs)[0] for X, y in tasks], axis=1)


def fit_global_svm(tasks: list[tuple[np.ndarray, np.ndarray]], lam: float,
                   **kwargs) -> np.ndarray:
    """One SVM on the pooled data (mean loss over all samples), c = lambda * m.

    Returns W = [w .. w] of shape (d, m).
    """
    X = np.vstack([X for X, _ in tasks])
    y = np.concatenate([y for _, y in tasks])
    w, _ = fit_linear_svm(X, y, lam * len(tasks), **kwargs)
    return np.repeat(w[:, None], len(tasks), axis=1)
