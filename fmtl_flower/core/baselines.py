"""Local solvers and server steps of MOCHA's baselines: CoCoA, Mb-SDCA and Mb-SGD.

All three share MOCHA's conventions (:mod:`fmtl_flower.core.sdca`): task t holds X (n x d,
rows are samples), labels y in {-1, +1}, committed dual variables alpha with
``0 <= y * alpha <= 1``, receives its model w = w_t(alpha) from the server and visits the
coordinates in the order ``order[s % n]`` (a permutation from
:func:`fmtl_flower.core.rng.coordinate_order`). The objective is MOCHA's W-step

    P(W) = sum_t L_t(w_t) + (1/2) tr(W K W^T),   L_t(w) = (1/n_t) sum_i max(0, 1 - y_ti x_ti^T w),

with K positive definite, M = K^-1, m_tt = M_tt, and dual variables b_t = X_t^T alpha_t / n_t,
W(alpha) = B K^-1. Everything here is pure numpy/numba (no Flower); the per-step loops are
compiled by numba when it is installed, else run by their numpy implementations (the
``*_numpy`` functions, :mod:`fmtl_flower.core.jit`). Zero-norm rows follow the one rule of
:mod:`fmtl_flower.core.sdca`: a step sets them to ``y_i a_i = 1``.

CoCoA (:func:`cocoa_local_update`)
    MOCHA's local subproblem, solved by SDCA until its *true* local duality gap, relative to
    the gap at ``d_alpha = 0``, is <= theta (one theta for every node and round), or until a
    step cap. Returns the number of steps, which varies across nodes and rounds.
Mb-SDCA (:func:`mbsdca_local_update`, :func:`mbsdca_scale`)
    Every coordinate step uses the stale model w_t; the server scales every update by
    beta / b, b the round's total number of coordinate steps.
Mb-SGD (:func:`mbsgd_local_gradient`, :func:`mbsgd_server_step`, :func:`mbsgd_step_size`,
:func:`mbsgd_radius`)
    Sums of hinge subgradients at the stale w_t; the server takes a projected stochastic
    subgradient step on P with the regulariser's gradient W K included.
"""

from __future__ import annotations

import math

import numpy as np

from .jit import kernel
from .sdca import _sdca_kernel_numpy

_FASTMATH = {"reassoc", "contract"}


# --------------------------------------------------------------------------------------------
# numpy implementations of the kernels (used when numba is missing)
# --------------------------------------------------------------------------------------------


def _sdca_steps_numpy(X, y, alpha, sqnorm, order, start, count, scale, d_alpha, v):
    """:func:`_sdca_steps` with numpy: MOCHA's kernel on the steps ``start..start+count-1``."""
    n = X.shape[0]
    if count <= 0:
        return
    shifted = np.roll(order, -(start % n))  # step start + s visits order[(start + s) % n]
    _sdca_kernel_numpy(X, y, alpha, sqnorm, v, shifted, count, scale, d_alpha, v)


def _local_gap_numpy(X, y, alpha, d_alpha, v):
    """:func:`_local_gap` with numpy."""
    n = X.shape[0]
    a = y * (alpha + d_alpha)
    r = 1.0 - y * (X @ v)
    terms = np.where(r > 0.0, (1.0 - a) * r, -a * r)
    return float(terms.sum()) / n


def _cocoa_kernel_numpy(X, y, alpha, sqnorm, order, scale, theta, max_steps, check_every,
                        d_alpha, v):
    """:func:`_cocoa_kernel` with numpy."""
    gap0 = _local_gap_numpy(X, y, alpha, d_alpha, v)
    if gap0 <= 0.0:
        return 0, 0.0
    target = theta * gap0
    steps = 0
    gap = gap0
    while steps < max_steps:
        block = min(check_every, max_steps - steps)
        _sdca_steps_numpy(X, y, alpha, sqnorm, order, steps, block, scale, d_alpha, v)
        steps += block
        gap = _local_gap_numpy(X, y, alpha, d_alpha, v)
        if gap <= target:
            break
    return steps, gap / gap0


def _mbsdca_kernel_numpy(X, y, alpha, sqnorm, w, order, budget, inv_m_tt, d_alpha):
    """:func:`_mbsdca_kernel` with numpy (every step at the stale w: one vector step)."""
    n = X.shape[0]
    idx = order[:budget]
    yi = y[idx]
    a_old = yi * (alpha[idx] + d_alpha[idx])
    xx = sqnorm[idx]
    zero = xx <= 0.0
    margins = yi * (X[idx] @ w)
    with np.errstate(divide="ignore", invalid="ignore"):
        a_new = a_old + (1.0 - margins) * (n * inv_m_tt / np.where(zero, 1.0, xx))
    a_new = np.where(zero, 1.0, np.clip(a_new, 0.0, 1.0))
    d_alpha[idx] += yi * (a_new - a_old)


def _mbsgd_kernel_numpy(X, y, w, order, budget, g):
    """:func:`_mbsgd_kernel` with numpy."""
    idx = order[:budget]
    yi = y[idx]
    active = yi * (X[idx] @ w) < 1.0
    g -= (yi[active]) @ X[idx][active]


def _sub_dalpha_numpy(X, d_alpha, out):
    """:func:`_sub_dalpha` with numpy."""
    out += X.T @ d_alpha
    out *= 1.0 / X.shape[0]


# --------------------------------------------------------------------------------------------
# compiled kernels
# --------------------------------------------------------------------------------------------


@kernel(_sdca_steps_numpy, boundscheck=False, fastmath=_FASTMATH)
def _sdca_steps(X, y, alpha, sqnorm, order, start, count, scale, d_alpha, v):  # pragma: no cover
    """Steps ``start .. start+count-1`` of SDCA on G; keeps ``v = w + scale * d_b``.

    Rows with ``|x_i| = 0`` are set to their exact coordinate maximiser ``y_i a_i = 1`` (their
    only term in G is ``y_i d_alpha_i / n``); they do not move v.
    """
    n, d = X.shape
    inv_n = 1.0 / n
    for s in range(start, start + count):
        i = order[s % n]
        yi = y[i]
        a_old = yi * (alpha[i] + d_alpha[i])
        xx = sqnorm[i]
        if xx <= 0.0:
            d_alpha[i] += yi * (1.0 - a_old)
            continue
        dot = 0.0
        for j in range(d):
            dot += X[i, j] * v[j]
        inv_q = 1.0 / (scale * xx * inv_n)
        a_new = a_old + (1.0 - yi * dot) * inv_q
        if a_new < 0.0:
            a_new = 0.0
        elif a_new > 1.0:
            a_new = 1.0
        if a_new != a_old:
            delta = yi * (a_new - a_old)
            d_alpha[i] += delta
            c = scale * delta * inv_n
            for j in range(d):
                v[j] += c * X[i, j]


@kernel(_local_gap_numpy, boundscheck=False, fastmath=_FASTMATH)
def _local_gap(X, y, alpha, d_alpha, v):  # pragma: no cover
    """(1/n) sum_i [max(0, 1 - m_i) - a_i (1 - m_i)], m_i = y_i x_i^T v, a_i = y_i alpha_new_i.

    Every term is >= 0 for a_i in [0, 1] (computed in a form that is exactly non-negative).
    """
    n, d = X.shape
    total = 0.0
    for i in range(n):
        dot = 0.0
        for j in range(d):
            dot += X[i, j] * v[j]
        yi = y[i]
        a = yi * (alpha[i] + d_alpha[i])
        r = 1.0 - yi * dot
        if r > 0.0:
            total += (1.0 - a) * r
        else:
            total -= a * r
    return total / n


@kernel(_cocoa_kernel_numpy, boundscheck=False, fastmath=_FASTMATH)
def _cocoa_kernel(X, y, alpha, sqnorm, order, scale, theta, max_steps, check_every,
                  d_alpha, v):  # pragma: no cover
    gap0 = _local_gap(X, y, alpha, d_alpha, v)
    if gap0 <= 0.0:
        return 0, 0.0
    target = theta * gap0
    steps = 0
    gap = gap0
    while steps < max_steps:
        block = min(check_every, max_steps - steps)
        _sdca_steps(X, y, alpha, sqnorm, order, steps, block, scale, d_alpha, v)
        steps += block
        gap = _local_gap(X, y, alpha, d_alpha, v)
        if gap <= target:
            break
    return steps, gap / gap0


@kernel(_mbsdca_kernel_numpy, boundscheck=False, fastmath=_FASTMATH)
def _mbsdca_kernel(X, y, alpha, sqnorm, w, order, budget, inv_m_tt, d_alpha):  # pragma: no cover
    n, d = X.shape
    fn = float(n)
    for s in range(budget):
        i = order[s]
        yi = y[i]
        a_old = yi * (alpha[i] + d_alpha[i])
        xx = sqnorm[i]
        if xx <= 0.0:
            d_alpha[i] += yi * (1.0 - a_old)
            continue
        dot = 0.0
        for j in range(d):
            dot += X[i, j] * w[j]
        a_new = a_old + (1.0 - yi * dot) * (fn * inv_m_tt / xx)
        if a_new < 0.0:
            a_new = 0.0
        elif a_new > 1.0:
            a_new = 1.0
        d_alpha[i] += yi * (a_new - a_old)


@kernel(_mbsgd_kernel_numpy, boundscheck=False, fastmath=_FASTMATH)
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


@kernel(_sub_dalpha_numpy, boundscheck=False, fastmath=_FASTMATH)
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


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# CoCoA
# --------------------------------------------------------------------------------------------


def cocoa_local_update(
    X: np.ndarray,
    y: np.ndarray,
    alpha: np.ndarray,
    w: np.ndarray,
    *,
    m_tt: float,
    sigma_prime: float,
    theta: float,
    max_steps: int,
    order: np.ndarray,
    check_every: int | None = None,
    sqnorm: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, int, float]:
    """CoCoA's local solver: SDCA on MOCHA's subproblem until a relative duality gap <= theta.

    **Local dual** (MOCHA eq. (4), maximisation form, as in :mod:`fmtl_flower.core.sdca`),
    with ``c = sigma' * m_tt`` and ``d_b = X^T d_alpha / n``::

        G(d_alpha) = (1/n) sum_i y_i (alpha_i + d_alpha_i) - w^T d_b - (c/2) |d_b|^2
        subject to 0 <= a_i := y_i (alpha_i + d_alpha_i) <= 1.

    **Local primal.** Writing ``-(c/2)|z|^2 = min_u (|u|^2 / (2c) - u^T z)`` and exchanging
    max and min (the box is compact) shows that G is the dual of the problem over a model
    correction u in R^d::

        P_loc(u) = (1/n) sum_i max(0, 1 - y_i x_i^T (w + u)) + b^T (w + u) + |u|^2 / (2c),

    ``b = X^T alpha / n``; ``P_loc(u) >= G(d_alpha)`` for every u and feasible d_alpha, with
    equality at the optimum, where ``u* = c d_b*``.

    **Gap.** At the pair ``(u = c d_b, d_alpha)`` -- i.e. at the local model
    ``v = w + c d_b`` that SDCA keeps anyway -- the gap simplifies to the familiar SVM
    certificate::

        gap(d_alpha) = P_loc(c d_b) - G(d_alpha)
                     = (1/n) sum_i [max(0, 1 - m_i) - a_i (1 - m_i)] >= 0,  m_i = y_i x_i^T v,

    an upper bound on the true suboptimality ``G* - G(d_alpha)``. At ``d_alpha = 0`` it is
    ``gap(0) = L_t(w_t) + w_t^T b_t - A_t``, the task's share of the global duality gap
    ``P - D`` when W = W(alpha) (the shares sum to it).

    **Stopping rule.** Checked before the first step and after every ``check_every`` steps
    (and at the cap): stop at the first check with ``gap(d_alpha) <= theta * gap(0)``, or
    after ``max_steps`` steps. As ``G* - G(0) <= gap(0)``, this certifies
    ``G* - G(d_alpha) <= theta * gap(0)``: the computable form of the paper's per-node
    accuracy theta (eq. (5) needs the unknown G*). One theta serves every node and round;
    the number of steps it takes is what varies. Each check costs one pass over the data
    (n dot products); :mod:`fmtl_flower.systems.timing` charges it.

    Each step is MOCHA's exact coordinate maximiser of G (see :mod:`fmtl_flower.core.sdca`);
    unlike MOCHA's kernel, a row with ``|x_i| = 0`` is set to its exact maximiser
    ``a_i = 1`` rather than skipped, so that the gap can close.

    Parameters
    ----------
    X : ndarray of shape (n, d)
        The task's training samples (rows).
    y : ndarray of shape (n,)
        Labels in {-1, +1}.
    alpha : ndarray of shape (n,)
        Committed dual variables, ``0 <= y * alpha <= 1``. Not modified.
    w : ndarray of shape (d,)
        The task's model ``w_t = W(alpha)[:, t]`` from the server.
    m_tt : float
        ``(K^-1)_tt`` (> 0).
    sigma_prime : float
        The aggregation parameter sigma' (> 0).
    theta : float
        Relative gap target, ``0 <= theta < 1`` (0: run to ``max_steps`` unless the gap
        closes exactly).
    max_steps : int
        Cap on the number of coordinate steps (>= 0).
    order : ndarray of shape (n,), int
        A permutation of ``0..n-1``; step s visits ``order[s % n]``.
    check_every : int, optional
        Coordinate steps between gap checks (>= 1); default n (one pass).
    sqnorm : ndarray of shape (n,), optional
        Precomputed squared row norms of X.

    Returns
    -------
    d_alpha : ndarray of shape (n,)
        The change of the dual variables; ``y * (alpha + d_alpha)`` stays in [0, 1].
    d_b : ndarray of shape (d,)
        ``X^T d_alpha / n``, the only vector sent to the server.
    steps : int
        Coordinate steps taken (gap checks not counted). The number of gap checks is
        ``1 + ceil(steps / check_every)``.
    rel_gap : float
        ``gap(d_alpha) / gap(0)`` at the last check (0.0 when ``gap(0) == 0``, then
        ``steps == 0``).
    """
    X, y, w, order, alpha = _validate(X, y, w, order, alpha)
    n, d = X.shape
    _check_positive("m_tt", float(m_tt))
    _check_positive("sigma_prime", float(sigma_prime))
    if not 0.0 <= theta < 1.0:
        raise ValueError(f"theta must be in [0, 1), got {theta}")
    max_steps = _check_steps("max_steps", max_steps)
    if check_every is None:
        check_every = max(n, 1)
    if isinstance(check_every, bool) or int(check_every) != check_every or check_every < 1:
        raise ValueError(f"check_every must be an integer >= 1, got {check_every}")
    sqnorm = _sqnorm(X, sqnorm)
    d_alpha = np.zeros(n)
    if n == 0:
        return d_alpha, np.zeros(d), 0, 0.0
    v = w.copy()
    scale = float(sigma_prime) * float(m_tt)
    steps, rel_gap = _cocoa_kernel(X, y, alpha, sqnorm, order, scale, float(theta),
                                   max_steps, int(check_every), d_alpha, v)
    d_b = np.zeros(d)
    _sub_dalpha(X, d_alpha, d_b)
    return d_alpha, d_b, int(steps), float(rel_gap)


def cocoa_local_gap(
    X: np.ndarray, y: np.ndarray, alpha: np.ndarray, w: np.ndarray, d_alpha: np.ndarray, *,
    m_tt: float, sigma_prime: float,
) -> float:
    """The local gap ``gap(d_alpha)`` of :func:`cocoa_local_update` (absolute, not relative).

    ``gap(0)`` (``d_alpha = 0``) is the task's share ``L_t(w_t) + w_t^T b_t - A_t`` of the
    global duality gap.
    """
    X, y, w, _, alpha = _validate(X, y, w, np.zeros(np.shape(X)[0]), alpha)
    d_alpha = np.ascontiguousarray(d_alpha, dtype=np.float64)
    if d_alpha.shape != alpha.shape:
        raise ValueError(f"d_alpha must have shape {alpha.shape}, got {d_alpha.shape}")
    _check_positive("m_tt", float(m_tt))
    _check_positive("sigma_prime", float(sigma_prime))
    if X.shape[0] == 0:
        return 0.0
    v = w + float(sigma_prime) * float(m_tt) * (X.T @ d_alpha) / X.shape[0]
    return float(_local_gap(X, y, alpha, d_alpha, v))


# --------------------------------------------------------------------------------------------
# Mb-SDCA
# --------------------------------------------------------------------------------------------


def mbsdca_local_update(
    X: np.ndarray,
    y: np.ndarray,
    alpha: np.ndarray,
    w: np.ndarray,
    *,
    m_tt: float,
    budget: int,
    order: np.ndarray,
    sqnorm: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Mini-batch SDCA's local step: ``budget`` coordinate steps, all at the stale model w_t.

    For the samples ``i = order[0 .. budget-1]`` (a mini-batch of distinct samples)::

        a_i <- clip(a_i + (1 - y_i x_i^T w_t) * n / (m_tt |x_i|^2), 0, 1),   a_i = y_i alpha_i,

    the exact maximiser of the local subproblem G over coordinate i alone, at ``d_alpha = 0``
    and sigma' = 1 (no local model progress: every margin uses the w_t the server sent,
    Takac et al. 2013, "Mini-batch primal and dual methods for SVMs"). Rows with
    ``|x_i| = 0`` are set to their maximiser ``a_i = 1``.

    The update is *not* applied as is: the server scales every task's update by
    ``s = mbsdca_scale(beta, b)`` (b = the round's total coordinate steps over the nodes that
    replied), i.e. ``b_t += s * d_b`` and the device commits ``alpha += s * d_alpha``, so s
    must reach the device with the next message. ``0 < s <= 1`` keeps
    ``y * (alpha + s d_alpha)`` in [0, 1] (a convex combination of two feasible points).

    Parameters
    ----------
    X, y, alpha, w, order
        As for :func:`cocoa_local_update`.
    m_tt : float
        ``(K^-1)_tt`` (> 0).
    budget : int
        Mini-batch size ``0 <= budget <= n``: samples ``order[:budget]`` are visited once.
    sqnorm : ndarray of shape (n,), optional
        Precomputed squared row norms of X.

    Returns
    -------
    d_alpha : ndarray of shape (n,)
        Unscaled change of the dual variables (non-zero only on the mini-batch).
    d_b : ndarray of shape (d,)
        ``X^T d_alpha / n`` (unscaled), the vector sent to the server.
    """
    X, y, w, order, alpha = _validate(X, y, w, order, alpha)
    n, d = X.shape
    _check_positive("m_tt", float(m_tt))
    budget = _check_steps("budget", budget, n)
    sqnorm = _sqnorm(X, sqnorm)
    d_alpha = np.zeros(n)
    d_b = np.zeros(d)
    if budget == 0:
        return d_alpha, d_b
    _mbsdca_kernel(X, y, alpha, sqnorm, w, order, budget, 1.0 / float(m_tt), d_alpha)
    _sub_dalpha(X, d_alpha, d_b)
    return d_alpha, d_b


def mbsdca_scale(beta: float, total_steps: int) -> float:
    """Server-side scaling ``s = min(1, beta / b)`` of Mb-SDCA's updates.

    Parameters
    ----------
    beta : float
        The aggregation parameter (> 0); the paper tunes beta in [1, b].
    total_steps : int
        b, the total number of coordinate steps of the round summed over the nodes whose
        updates are applied (as in the reference, ``sum_t H_t``; dropped nodes count 0).

    Returns
    -------
    float
        s in [0, 1]: ``beta / b`` clipped at 1 so that the scaled dual update stays feasible
        when b < beta (e.g. most nodes dropped); 0.0 when b == 0 (nothing to apply).
    """
    _check_positive("beta", float(beta))
    b = _check_steps("total_steps", total_steps)
    if b == 0:
        return 0.0
    return min(1.0, float(beta) / b)


# --------------------------------------------------------------------------------------------
# Mb-SGD
# --------------------------------------------------------------------------------------------


def mbsgd_local_gradient(
    X: np.ndarray, y: np.ndarray, w: np.ndarray, *, budget: int, order: np.ndarray,
) -> tuple[np.ndarray, int]:
    """Sum of hinge subgradients over a mini-batch, at the stale model w_t.

    ``g = sum_{i in S} -y_i x_i [y_i x_i^T w < 1]`` over ``S = order[:budget]`` (distinct
    samples), a subgradient of ``sum_{i in S} max(0, 1 - y_i x_i^T w)`` (the subgradient 0 is
    taken at the kink ``y_i x_i^T w = 1``). Note the sign: this is the subgradient itself, the
    reference accumulates its negative.

    Parameters
    ----------
    X, y, w, order
        As for :func:`cocoa_local_update`.
    budget : int
        Mini-batch size ``0 <= budget <= n``.

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
    g = np.zeros(d)
    if budget:
        _mbsgd_kernel(X, y, w, order, budget, g)
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


def mbsgd_radius(K: np.ndarray) -> float:
    """Radius ``sqrt(m / lambda_min(K))`` of a Frobenius ball that contains the optimum W*.

    Derivation: at the optimum, W* K = B* (stationarity) and strong duality P* = D* give
    ``sum_t L_t + R/2 = sum_t A_t - R/2`` with ``R = tr(W* K W*^T)``, so
    ``R = sum_t A_t - sum_t L_t <= sum_t A_t <= m`` (``A_t = (1/n_t) sum_i y_i alpha_i`` is a
    mean of numbers in [0, 1]). As ``R >= lambda_min(K) |W*|_F^2``,
    ``|W*|_F <= sqrt(m / lambda_min(K))``. (For m = 1, K = lambda: Pegasos's 1/sqrt(lambda).
    The cruder ``P* <= P(0) = m`` gives only ``sqrt(2m / lambda_min)``.)
    """
    K = np.asarray(K, dtype=np.float64)
    if K.ndim != 2 or K.shape[0] != K.shape[1] or K.shape[0] == 0:
        raise ValueError(f"K must be a non-empty square matrix, got shape {K.shape}")
    lam_min = float(np.linalg.eigvalsh(0.5 * (K + K.T))[0])
    if not lam_min > 0.0:
        raise ValueError(f"K must be positive definite, smallest eigenvalue {lam_min}")
    return math.sqrt(K.shape[0] / lam_min)


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
