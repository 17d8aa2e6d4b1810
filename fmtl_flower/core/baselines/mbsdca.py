"""Mb-SDCA: every coordinate step at the stale model w_t, the server scaling the update by
beta / b (see :mod:`fmtl_flower.core.baselines`)."""

from __future__ import annotations

import numpy as np

from ..jit import kernel, steps_work, vector_work
from ..losses import (
    HINGE,
    LOSS_BY_CODE,
    Loss,
    compiled_loss_call,
    coordinate_step,
    get_loss,
    numpy_step_cost_of,
)
from ..sdca import FASTMATH, _clip01, _step_start
from ._common import _check_positive, _check_steps, _sqnorm, _sub_dalpha, _validate


def _mbsdca_kernel_numpy(X, y, alpha, sqnorm, w, order, budget, inv_m_tt, d_alpha, loss):
    """:func:`_mbsdca_kernel` with numpy (every step at the stale w: one vector step; a loss
    other than the hinge: one scalar step per sample)."""
    n = X.shape[0]
    idx = order[:budget]
    yi = y[idx]
    a_old = yi * (alpha[idx] + d_alpha[idx])
    xx = sqnorm[idx]
    zero = xx <= 0.0
    margins = yi * (X[idx] @ w)
    if loss == HINGE:
        with np.errstate(divide="ignore", invalid="ignore"):
            a_new = a_old + (1.0 - margins) * (n * inv_m_tt / np.where(zero, 1.0, xx))
        a_new = np.where(zero, 1.0, np.clip(a_new, 0.0, 1.0))
    else:  # q = 0 on a zero row: the step is the zero-row rule's argmax D
        step = LOSS_BY_CODE[loss].sdca_step
        q = np.where(zero, 0.0, xx / (n * inv_m_tt)).tolist()
        z = np.where(zero, 0.0, margins).tolist()
        a_new = np.array([step(a, zi, qi)
                          for a, zi, qi in zip(a_old.tolist(), z, q, strict=True)])
    d_alpha[idx] += yi * (a_new - a_old)


@kernel(_mbsdca_kernel_numpy, boundscheck=False, fastmath=FASTMATH, compiles=compiled_loss_call,
        work=lambda X, y, alpha, sqnorm, w, order, budget, inv_m_tt, d_alpha, loss:
        vector_work(budget * X.shape[1]) if loss == HINGE
        else steps_work(budget, X.shape[1]) * numpy_step_cost_of(loss))
def _mbsdca_kernel(X, y, alpha, sqnorm, w, order, budget, inv_m_tt, d_alpha,
                   loss):  # pragma: no cover
    """The SDCA family's coordinate step (:func:`~fmtl_flower.core.sdca._step_start`, its
    zero-row rule) of the loss with code ``loss`` for ``order[:budget]``, every step at the
    stale ``w``."""
    fn = float(X.shape[0])
    for s in range(budget):
        i = order[s]
        yi, a_old, xx, dot = _step_start(X, y, alpha, sqnorm, d_alpha, w, i, loss)
        if xx <= 0.0:
            continue
        if loss == HINGE:
            a_new = _clip01(a_old + (1.0 - yi * dot) * (fn * inv_m_tt / xx))
        else:
            a_new = coordinate_step(loss, a_old, yi * dot, xx / (fn * inv_m_tt))
        d_alpha[i] += yi * (a_new - a_old)


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
    loss: str | Loss = "hinge",
) -> tuple[np.ndarray, np.ndarray]:
    """Mini-batch SDCA's local step: ``budget`` coordinate steps, all at the stale model w_t.

    For the samples ``i = order[0 .. budget-1]`` (a mini-batch of distinct samples)::

        a_i <- clip(a_i + (1 - y_i x_i^T w_t) * n / (m_tt |x_i|^2), 0, 1),   a_i = y_i alpha_i,

    (for the hinge; another loss: :func:`~fmtl_flower.core.losses.coordinate_step` with
    z = y_i x_i^T w_t and q = m_tt |x_i|^2 / n),
    the exact maximiser of the local subproblem G over coordinate i alone, at ``d_alpha = 0``
    and sigma' = 1 (no local model progress: every margin uses the w_t the server sent,
    Takac et al. 2013, "Mini-batch primal and dual methods for SVMs"). Rows with
    ``|x_i| = 0`` are set to their maximiser ``a_i = 1``.

    The update is *not* applied as is: the server scales every task's update by
    ``s = mbsdca_scale(beta, b)`` (b = the round's total coordinate steps over the nodes that
    replied), i.e. ``b_t += s * d_b`` and the device commits ``alpha += s * d_alpha``, so s
    must reach the device with the next message. ``0 < s <= 1`` keeps
    ``y * (alpha + s d_alpha)`` in the loss's dual domain (a convex combination of two
    feasible points: the domain is convex, for every loss).

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
    loss : str or Loss, default "hinge"
        A loss of :data:`~fmtl_flower.core.losses.LOSSES` (or its name).

    Returns
    -------
    d_alpha : ndarray of shape (n,)
        Unscaled change of the dual variables (non-zero only on the mini-batch).
    d_b : ndarray of shape (d,)
        ``X^T d_alpha / n`` (unscaled), the vector sent to the server.
    """
    X, y, w, order, alpha = _validate(X, y, w, order, alpha)
    code = get_loss(loss).code
    n, d = X.shape
    _check_positive("m_tt", float(m_tt))
    budget = _check_steps("budget", budget, n)
    sqnorm = _sqnorm(X, sqnorm)
    d_alpha = np.zeros(n)
    d_b = np.zeros(d)
    if budget == 0:
        return d_alpha, d_b
    _mbsdca_kernel(X, y, alpha, sqnorm, w, order, budget, 1.0 / float(m_tt), d_alpha, code)
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
