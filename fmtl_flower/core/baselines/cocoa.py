"""CoCoA: MOCHA's local subproblem solved by SDCA until its relative local duality gap is
<= theta (see :mod:`fmtl_flower.core.baselines`); the SDCA steps are MOCHA's kernel
(:func:`fmtl_flower.core.sdca._sdca_steps`)."""

from __future__ import annotations

import numpy as np

from ..jit import kernel, steps_work, vector_work
from ..losses import (
    HINGE,
    LOSS_BY_CODE,
    Loss,
    compiled_loss_call,
    dual_value,
    get_loss,
    loss_value,
    numpy_step_cost_of,
)
from ..sdca import FASTMATH, _sdca_steps
from ._common import _check_positive, _check_steps, _sqnorm, _sub_dalpha, _validate


def _local_gap_numpy(X, y, alpha, d_alpha, v, loss):
    """:func:`_local_gap` with numpy."""
    n = X.shape[0]
    a = y * (alpha + d_alpha)
    if loss != HINGE:
        of = LOSS_BY_CODE[loss]
        m = y * (X @ v)
        return float((of.value(m) - of.dual(a) + a * m).sum()) / n
    r = 1.0 - y * (X @ v)
    terms = np.where(r > 0.0, (1.0 - a) * r, -a * r)
    return float(terms.sum()) / n


@kernel(_local_gap_numpy, boundscheck=False, fastmath=FASTMATH, compiles=compiled_loss_call,
        work=lambda X, y, alpha, d_alpha, v, loss: vector_work(X.size))
def _local_gap(X, y, alpha, d_alpha, v, loss):  # pragma: no cover
    """(1/n) sum_i [l(m_i) - D(a_i) + a_i m_i], m_i = y_i x_i^T v, a_i = y_i alpha_new_i, for
    the loss with code ``loss``: every term is >= 0 (Fenchel-Young). The hinge's,
    max(0, 1 - m_i) - a_i (1 - m_i), is computed in a form that is exactly non-negative."""
    n, d = X.shape
    total = 0.0
    for i in range(n):
        dot = 0.0
        for j in range(d):
            dot += X[i, j] * v[j]
        yi = y[i]
        a = yi * (alpha[i] + d_alpha[i])
        if loss != HINGE:
            m = yi * dot
            total += loss_value(loss, m) - dual_value(loss, a) + a * m
            continue
        r = 1.0 - yi * dot
        if r > 0.0:
            total += (1.0 - a) * r
        else:
            total -= a * r
    return total / n


def _cocoa_work(X, y, alpha, sqnorm, order, scale, theta, max_steps, check_every, d_alpha,
                v, loss):
    """At most ``max_steps`` SDCA steps and a gap check (n rows) every ``check_every``."""
    checks = 1 + -(-max_steps // max(check_every, 1))
    return (steps_work(max_steps, X.shape[1]) * numpy_step_cost_of(loss)
            + checks * vector_work(X.size))


@kernel(boundscheck=False, fastmath=FASTMATH, work=_cocoa_work, compiles=compiled_loss_call)
def _cocoa_kernel(X, y, alpha, sqnorm, order, scale, theta, max_steps, check_every,
                  d_alpha, v, loss):  # pragma: no cover
    """SDCA blocks of ``check_every`` steps until the local gap is <= theta times its start
    value or ``max_steps``: (steps, final gap / start gap). Without numba it runs as Python
    over the numpy :func:`_local_gap` and :func:`~fmtl_flower.core.sdca._sdca_steps`."""
    gap0 = _local_gap(X, y, alpha, d_alpha, v, loss)
    if gap0 <= 0.0:
        return 0, 0.0
    target = theta * gap0
    steps = 0
    gap = gap0
    while steps < max_steps:
        block = min(check_every, max_steps - steps)
        _sdca_steps(X, y, alpha, sqnorm, order, steps, block, scale, d_alpha, v, loss)
        steps += block
        gap = _local_gap(X, y, alpha, d_alpha, v, loss)
        if theta > 0.0 and gap <= target:  # theta = 0: no target (a gap that reaches 0
            break  # does so by rounding, differently with and without numba's fastmath)
    return steps, gap / gap0


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
    loss: str | Loss = "hinge",
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

    an upper bound on the true suboptimality ``G* - G(d_alpha)``. For another loss
    (:mod:`fmtl_flower.core.losses`, D(a) = -l*(-a)) the same derivation gives
    ``gap(d_alpha) = (1/n) sum_i [l(m_i) - D(a_i) + a_i m_i] >= 0`` (Fenchel-Young).
    At ``d_alpha = 0`` it is
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
    a row with ``|x_i| = 0`` is set to its exact maximiser ``a_i = 1`` (the one zero-row
    rule of the SDCA kernels), so that the gap can close.

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
        Relative gap target, ``0 <= theta < 1`` (0: run to ``max_steps``; a gap of exactly
        0 mid-run is a matter of rounding, so it does not stop the solver either).
    max_steps : int
        Cap on the number of coordinate steps (>= 0).
    order : ndarray of shape (n,), int
        A permutation of ``0..n-1``; step s visits ``order[s % n]``.
    check_every : int, optional
        Coordinate steps between gap checks (>= 1); default n (one pass).
    sqnorm : ndarray of shape (n,), optional
        Precomputed squared row norms of X.
    loss : str or Loss, default "hinge"
        A loss of :data:`~fmtl_flower.core.losses.LOSSES` (or its name).

    Returns
    -------
    d_alpha, d_b : ndarray of shape (n,), ndarray of shape (d,)
        As for :func:`fmtl_flower.core.sdca.sdca_local_update`.
    steps : int
        Coordinate steps taken (gap checks not counted). The number of gap checks is
        ``1 + ceil(steps / check_every)``.
    rel_gap : float
        ``gap(d_alpha) / gap(0)`` at the last check (0.0 when ``gap(0) == 0``, then
        ``steps == 0``).
    """
    X, y, w, order, alpha = _validate(X, y, w, order, alpha)
    code = get_loss(loss).code
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
                                   max_steps, int(check_every), d_alpha, v, code)
    d_b = np.zeros(d)
    _sub_dalpha(X, d_alpha, d_b)
    return d_alpha, d_b, int(steps), float(rel_gap)


def cocoa_local_gap(
    X: np.ndarray, y: np.ndarray, alpha: np.ndarray, w: np.ndarray, d_alpha: np.ndarray, *,
    m_tt: float, sigma_prime: float, loss: str | Loss = "hinge",
) -> float:
    """The local gap ``gap(d_alpha)`` of :func:`cocoa_local_update` (absolute, not relative).

    ``gap(0)`` (``d_alpha = 0``) is the task's share ``L_t(w_t) + w_t^T b_t - A_t`` of the
    global duality gap.
    """
    X, y, w, _, alpha = _validate(X, y, w, np.zeros(np.shape(X)[0]), alpha)
    code = get_loss(loss).code
    d_alpha = np.ascontiguousarray(d_alpha, dtype=np.float64)
    if d_alpha.shape != alpha.shape:
        raise ValueError(f"d_alpha must have shape {alpha.shape}, got {d_alpha.shape}")
    _check_positive("m_tt", float(m_tt))
    _check_positive("sigma_prime", float(sigma_prime))
    if X.shape[0] == 0:
        return 0.0
    v = w + float(sigma_prime) * float(m_tt) * (X.T @ d_alpha) / X.shape[0]
    return float(_local_gap(X, y, alpha, d_alpha, v, code))
