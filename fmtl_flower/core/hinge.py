"""Hinge loss, its convex conjugate, and the per-task sums MOCHA's objective is made of.

The MOCHA objective (reference code and paper, Smith et al. 2017) is

    P(W) = sum_t (1/n_t) sum_i max(0, 1 - y_ti x_ti^T w_t) + R(W),

a sum over tasks of each task's *mean* hinge loss. With dual variables alpha_ti whose signed
value a = y * alpha lies in [0, 1], the conjugate term of the hinge is -y * alpha, so the dual's
data part is sum_t (1/n_t) sum_i y_ti alpha_ti.
"""

from __future__ import annotations

import numpy as np


def hinge_loss(margins: np.ndarray) -> np.ndarray:
    """Elementwise hinge loss ``max(0, 1 - margin)`` where ``margin = y * x^T w``."""
    return np.maximum(0.0, 1.0 - margins)


def mean_hinge_loss(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """Mean hinge loss ``(1/n) sum_i max(0, 1 - y_i x_i^T w)`` of one task (0.0 if ``n == 0``)."""
    if X.shape[0] == 0:
        return 0.0
    return float(hinge_loss(y * (X @ w)).mean())


def hinge_conjugate_value(alpha: np.ndarray, y: np.ndarray) -> float:
    """Mean of ``-l*(-alpha_i)`` for the hinge loss: ``(1/n) sum_i y_i alpha_i``.

    Valid only inside the dual box ``0 <= y_i alpha_i <= 1`` (outside it the conjugate is
    ``+inf``); :func:`check_dual_feasible` tests that.
    """
    if alpha.shape[0] == 0:
        return 0.0
    return float(np.dot(y, alpha) / alpha.shape[0])


def check_dual_feasible(alpha: np.ndarray, y: np.ndarray, tol: float = 1e-12) -> bool:
    """Whether every ``y_i * alpha_i`` lies in ``[0, 1]`` (up to ``tol``)."""
    a = y * alpha
    return bool(np.all(a >= -tol) and np.all(a <= 1.0 + tol))


def classification_errors(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> int:
    """Number of test samples with ``sign(x^T w) != y``; a zero score counts as an error."""
    if X.shape[0] == 0:
        return 0
    return int(np.count_nonzero(y * (X @ w) <= 0.0))
