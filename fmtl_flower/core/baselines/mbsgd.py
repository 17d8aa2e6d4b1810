"""Mb-SGD: sums of the loss's (sub)gradients at the stale w_t on the devices (the hinge's by
default), a projected stochastic subgradient step on P (the regulariser's gradient W K
included) on the server (see :mod:`fmtl_flower.core.baselines`)."""

from __future__ import annotations

import math

import numpy as np

from ..jit import kernel, vector_work
from ..losses import Loss, get_loss
from ..sdca import FASTMATH
from ._common import _check_positive, _check_steps, _validate


def _mbsgd_kernel_numpy(X, y, w, order, budget, g):
    """:func:`_mbsgd_kernel` with numpy."""
    idx = order[:budget]
    yi = y[idx]
    active = yi * (X[idx] @ w) < 1.0
    g -= (yi[active]) @ X[idx][active]


@kernel(_mbsgd_kernel_numpy, boundscheck=False, fastmath=FASTMATH,
        work=lambda X, y, w, order, budget, g: vector_work(budget * X.shape[1]))
def _mbsgd_kernel(X, y, w, order, budget, g):  # pragma: no cover
    d = X.shape[1]
    for s in range(budget):
        i = order[s]
        dot = 0.0
        for j in range(d):
            dot += X[i, j] * w[j]
        yi = y[i]
        if yi * dot < 1.0:
            for j in range(d):
                g[j] -= yi * X[i, j]


def mbsgd_local_gradient(
    X: np.ndarray, y: np.ndarray, w: np.ndarray, *, budget: int, order: np.ndarray,
    loss: str | Loss = "hinge",
) -> tuple[np.ndarray, int]:
    """Sum of the loss's (sub)gradients over a mini-batch, at the stale model w_t.

    ``g = sum_{i in S} l'(z_i) y_i x_i``, z_i = y_i x_i^T w, over ``S = order[:budget]``
    (distinct samples), a subgradient of ``sum_{i in S} l(z_i)``, l' the loss's
    :meth:`~fmtl_flower.core.losses.Loss.derivative`. For the hinge (the default) that is
    ``sum_{i in S} -y_i x_i [z_i < 1]`` (the subgradient 0 is taken at the kink z = 1), run
    by its own kernel (compiled when large, as before); any other loss by numpy. Note the
    sign: this is the subgradient itself, the reference accumulates its negative.

    Parameters
    ----------
    X, y, w, order
        As for :func:`cocoa_local_update`.
    budget : int
        Mini-batch size ``0 <= budget <= n``.
    loss : str or Loss
        A registered loss with a ``derivative`` (:mod:`fmtl_flower.core.losses`).

    Returns
    -------
    g : ndarray of shape (d,)
        The summed subgradient, sent to the server.
    steps : int
        The number of sampled points ``|S| = budget`` (the server divides g by it: the
        per-task mean, see :func:`mbsgd_server_step`).
    """
    X, y, w, order, _ = _validate(X, y, w, order)
    n, d = X.shape
    budget = _check_steps("budget", budget, n)
    loss = get_loss(loss)
    g = np.zeros(d)
    if budget and loss.name == "hinge":
        _mbsgd_kernel(X, y, w, order, budget, g)
    elif budget:
        idx = order[:budget]
        yi = y[idx]
        g += (yi * loss.derivative(yi * (X[idx] @ w))) @ X[idx]
    return g, budget


def mbsgd_step_size(server_round: int, *, beta: float, schedule: str = "inv") -> float:
    """Decaying step size of Mb-SGD in round h >= 1.

    ``"inv"``: ``beta / h``. P is mu-strongly convex with ``mu = lambda_min(K)``; with
    ``beta = 1 / mu`` this is Pegasos's rule (Shalev-Shwartz et al. 2011), E[P] - P* =
    O(log h / (mu h)) with the projection of :func:`mbsgd_server_step`.
    ``"inv_sqrt"``: ``beta / sqrt(h)``, the rule for a merely convex objective
    (O(1 / sqrt(h)) for averaged iterates), more forgiving of a badly tuned beta.
    """
    if isinstance(server_round, bool) or int(server_round) != server_round or server_round < 1:
        raise ValueError(f"server_round must be an integer >= 1, got {server_round}")
    _check_positive("beta", float(beta))
    if schedule == "inv":
        return float(beta) / server_round
    if schedule == "inv_sqrt":
        return float(beta) / math.sqrt(server_round)
    raise ValueError(f"schedule must be 'inv' or 'inv_sqrt', got {schedule!r}")


def mbsgd_radius(K: np.ndarray, dual_max: float = 1.0) -> float:
    """Radius ``sqrt(m dual_max / lambda_min(K))`` of a Frobenius ball that contains the
    optimum W*, ``dual_max`` the largest value of the loss's dual term D (its
    ``dual_range[1]``: 1 for the hinge, the default).

    Derivation: at the optimum, W* K = B* (stationarity) and strong duality P* = D* give
    ``sum_t L_t + R/2 = sum_t A_t - R/2`` with ``R = tr(W* K W*^T)``, so
    ``R = sum_t A_t - sum_t L_t <= sum_t A_t <= m dual_max`` for a loss l >= 0
    (``A_t = (1/n_t) sum_i D(y_i alpha_i)``, for the hinge the mean of y_i alpha_i in [0, 1]).
    As ``R >= lambda_min(K) |W*|_F^2``, ``|W*|_F <= sqrt(m dual_max / lambda_min(K))``. (For
    m = 1, K = lambda and the hinge: Pegasos's 1/sqrt(lambda). The cruder
    ``P* <= P(0) = m`` gives only ``sqrt(2m / lambda_min)``.)
    """
    K = np.asarray(K, dtype=np.float64)
    if K.ndim != 2 or K.shape[0] != K.shape[1] or K.shape[0] == 0:
        raise ValueError(f"K must be a non-empty square matrix, got shape {K.shape}")
    lam_min = float(np.linalg.eigvalsh(0.5 * (K + K.T))[0])
    if not lam_min > 0.0:
        raise ValueError(f"K must be positive definite, smallest eigenvalue {lam_min}")
    if not dual_max > 0.0:
        raise ValueError(f"dual_max must be > 0 (inf: no finite ball), got {dual_max}")
    return math.sqrt(K.shape[0] * dual_max / lam_min)


def mbsgd_server_step(
    W: np.ndarray,
    G: np.ndarray,
    K: np.ndarray,
    *,
    counts: np.ndarray,
    step: float,
    radius: float | None = None,
) -> np.ndarray:
    """One projected stochastic subgradient step of Mb-SGD on P(W).

    With ``g_t`` the summed subgradient of task t over its ``counts[t]`` sampled points
    (:func:`mbsgd_local_gradient`), the estimate of the subgradient of
    ``P(W) = sum_t L_t(w_t) + (1/2) tr(W K W^T)`` is::

        Ghat = [g_1 / counts_1, ..., g_m / counts_m] + W K,

    each task's loss gradient a *per-task mean* over its own sample (as P weights every task's
    mean loss equally; not a pooled mean over all sampled points), plus the regulariser's exact
    gradient W K (K symmetric; the reference omits lambda here). Tasks with ``counts[t] == 0``
    (dropped) contribute no loss term that round; their column still moves by ``(W K)_t``.
    Then::

        W <- W - step * Ghat,   and, when ``radius`` is given,
        W <- W * min(1, radius / |W|_F)

    (Euclidean projection onto the Frobenius ball; with :func:`mbsgd_radius` the ball
    contains W*, so projecting never moves away from it). The full step costs O(d m^2).

    Parameters
    ----------
    W : ndarray of shape (d, m)
        Current models.
    G : ndarray of shape (d, m)
        Column t is task t's summed subgradient g_t (zeros for a dropped task).
    K : ndarray of shape (m, m)
        The regulariser's symmetric positive definite matrix.
    counts : ndarray of shape (m,)
        Sampled points per task (>= 0).
    step : float
        Step size (> 0), e.g. :func:`mbsgd_step_size`.
    radius : float, optional
        Projection radius (> 0), e.g. :func:`mbsgd_radius`; no projection when omitted.

    Returns
    -------
    ndarray of shape (d, m)
        The new models (W is not modified).
    """
    W = np.asarray(W, dtype=np.float64)
    if W.ndim != 2:
        raise ValueError(f"W must be a 2-D array (d, m), got shape {W.shape}")
    d, m = W.shape
    G = np.asarray(G, dtype=np.float64)
    if G.shape != (d, m):
        raise ValueError(f"G must have shape ({d}, {m}), got {G.shape}")
    K = np.asarray(K, dtype=np.float64)
    if K.shape != (m, m):
        raise ValueError(f"K must have shape ({m}, {m}), got {K.shape}")
    counts = np.asarray(counts)
    if counts.shape != (m,) or np.any(counts < 0):
        raise ValueError(f"counts must be {m} non-negative numbers, got {counts!r}")
    _check_positive("step", float(step))
    if radius is not None:
        _check_positive("radius", float(radius))
    safe = np.where(counts > 0, counts, 1).astype(np.float64)
    grad = W @ K + np.where(counts > 0, G / safe, 0.0)
    W_new = W - float(step) * grad
    if radius is not None:
        norm = float(np.linalg.norm(W_new))
        if norm > radius:
            W_new *= radius / norm
    return W_new


def mbsgd_objective(tasks, W: np.ndarray, K: np.ndarray) -> float:
    """``P(W) = sum_t L_t(w_t) + (1/2) tr(W K W^T)`` for tasks ``[(X_t, y_t), ...]``."""
    loss = sum(float(np.maximum(0.0, 1.0 - y * (X @ W[:, t])).mean()) if X.shape[0] else 0.0
               for t, (X, y) in enumerate(tasks))
    return loss + 0.5 * float(np.einsum("ij,ij->", W @ K, W))
