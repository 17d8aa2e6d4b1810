"""What the baselines' local solvers share: argument checks and ``d_b = X^T d_alpha / n``."""

from __future__ import annotations

import math

import numpy as np

from ..jit import kernel, vector_work
from ..sdca import FASTMATH


def _sub_dalpha_numpy(X, d_alpha, out):
    """:func:`_sub_dalpha` with numpy."""
    out += X.T @ d_alpha
    out *= 1.0 / X.shape[0]


@kernel(_sub_dalpha_numpy, boundscheck=False, fastmath=FASTMATH,
        work=lambda X, d_alpha, out: vector_work(X.size))
def _sub_dalpha(X, d_alpha, out):  # pragma: no cover
    """out = X^T d_alpha / n, skipping zero entries (only visited rows are non-zero)."""
    n, d = X.shape
    for i in range(n):
        a = d_alpha[i]
        if a != 0.0:
            for j in range(d):
                out[j] += a * X[i, j]
    inv_n = 1.0 / n
    for j in range(d):
        out[j] *= inv_n


def _validate(X, y, w, order, alpha=None):
    X = np.ascontiguousarray(X, dtype=np.float64)
    if X.ndim != 2:
        raise ValueError(f"X must be a 2-D array (n, d), got shape {X.shape}")
    n, d = X.shape
    y = np.ascontiguousarray(y, dtype=np.float64)
    if y.shape != (n,):
        raise ValueError(f"y must have shape ({n},), got {y.shape}")
    w = np.ascontiguousarray(w, dtype=np.float64)
    if w.shape != (d,):
        raise ValueError(f"w must have shape ({d},), got {w.shape}")
    order = np.ascontiguousarray(order, dtype=np.int64)
    if order.shape != (n,):
        raise ValueError(f"order must have shape ({n},), got {order.shape}")
    if alpha is not None:
        alpha = np.ascontiguousarray(alpha, dtype=np.float64)
        if alpha.shape != (n,):
            raise ValueError(f"alpha must have shape ({n},), got {alpha.shape}")
    return X, y, w, order, alpha


def _check_positive(name, value):
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


def _check_steps(name, value, n=None):
    try:
        ok = not isinstance(value, bool) and int(value) == value and value >= 0
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be an integer >= 0, got {value}")
    if n is not None and value > n:
        raise ValueError(f"{name} must be <= n = {n} (a mini-batch is a set of distinct "
                         f"samples), got {value}")
    return int(value)


def _sqnorm(X, sqnorm):
    if sqnorm is None:
        return np.einsum("ij,ij->i", X, X)
    sqnorm = np.ascontiguousarray(sqnorm, dtype=np.float64)
    if sqnorm.shape != (X.shape[0],):
        raise ValueError(f"sqnorm must have shape ({X.shape[0]},), got {sqnorm.shape}")
    return sqnorm
