"""CoCoA+ on the logistic dual: the node's SDCA with safeguarded Newton coordinate steps,
the adding aggregation, the primal point w(alpha) and the dual objective (see
:mod:`fmtl_flower.core.fsvrg`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fmtl_flower.core.jit import kernel, steps_work
from fmtl_flower.core.losses import _sigmoid  # one home of the overflow-safe sigmoid

from .logistic import (
    _as_csr,
    _as_labels,
    _as_order,
    _as_vector,
    _csr_rows,
    _positive,
)


@kernel()
def _logistic_coordinate(c0, q, beta0, max_newton, tol):  # pragma: no cover - compiled
    """The ``beta in (0, 1)`` maximising ``H(beta) - c0 (beta - beta0) - q/2 (beta - beta0)^2``.

    ``H`` is the binary entropy. In ``u = logit(beta)`` the optimality condition is
    ``r(u) = u + c0 + q (sigmoid(u) - beta0) = 0``, ``r' = 1 + q sigmoid'(u) >= 1``; the root
    lies in ``[-c0 - q (1 - beta0), -c0 + q beta0]``. Newton steps, kept inside the shrinking
    bracket by bisection.
    """
    lo = -c0 - q * (1.0 - beta0)
    hi = -c0 + q * beta0
    if hi - lo <= 0.0:
        return _sigmoid(lo)
    # start: one fixed-point step from u = -c0, clipped into the bracket
    u = -c0 - q * (_sigmoid(-c0) - beta0)
    if u <= lo or u >= hi:
        u = 0.5 * (lo + hi)
    for _ in range(max_newton):
        sg = _sigmoid(u)
        r = u + c0 + q * (sg - beta0)
        if abs(r) <= tol * (1.0 + abs(u)):
            break
        if r > 0.0:
            hi = u
        else:
            lo = u
        u_new = u - r / (1.0 + q * sg * (1.0 - sg))
        if not (lo < u_new < hi):
            u_new = 0.5 * (lo + hi)
        if u_new == u:
            break
        u = u_new
    return _sigmoid(u)


def _cocoa_numpy(indptr, indices, data, y, alpha, sqnorm, order, scale, max_newton, tol,
                 d_alpha, v):
    """:func:`_cocoa_kernel` with numpy: one Python step per coordinate of ``order`` (its
    Newton iterations in Python), the row's entries as numpy slices."""
    rows, add = _csr_rows(indptr, indices, data, order)
    ys, sq = y.tolist(), sqnorm.tolist()
    for i, cols, vals in rows:
        m = float(vals @ v[cols])
        yi = ys[i]
        beta0 = yi * (float(alpha[i]) + float(d_alpha[i]))
        beta = _logistic_coordinate(yi * m, scale * sq[i], beta0, max_newton, tol)
        delta = yi * (beta - beta0)
        if delta != 0.0:
            d_alpha[i] += delta
            add(v, cols, (scale * delta) * vals)


#: A CoCoA+ coordinate step (a few Newton iterations in Python) costs about this many numpy
#: SDCA steps (:data:`fmtl_flower.core.jit.STEP_US`; measured 8.65 by
#: ``benchmarks/kernel_breakeven.py``).
_NEWTON_STEPS = 9.0


@kernel(_cocoa_numpy, boundscheck=False,
        work=lambda indptr, indices, data, y, alpha, sqnorm, order, *_: _NEWTON_STEPS
        * steps_work(order.shape[0], data.shape[0] / max(indptr.shape[0] - 1, 1)))
def _cocoa_kernel(indptr, indices, data, y, alpha, sqnorm, order, scale, max_newton, tol,
                  d_alpha, v):  # pragma: no cover - compiled
    for t in range(order.shape[0]):
        i = order[t]
        start = indptr[i]
        stop = indptr[i + 1]
        m = 0.0
        for p in range(start, stop):
            m += data[p] * v[indices[p]]
        yi = y[i]
        beta0 = yi * (alpha[i] + d_alpha[i])
        beta = _logistic_coordinate(yi * m, scale * sqnorm[i], beta0, max_newton, tol)
        delta = yi * (beta - beta0)
        if delta != 0.0:
            d_alpha[i] += delta
            c = scale * delta
            for p in range(start, stop):
                v[indices[p]] += c * data[p]


def cocoa_plus_local_sdca(
    X: Any,
    y: Any,
    alpha: Any,
    w: Any,
    *,
    lam: float,
    n: int,
    sigma_prime: float,
    order: Any,
    max_newton: int = 30,
    tol: float = 1e-13,
) -> tuple[np.ndarray, np.ndarray]:
    """Node-side CoCoA+ local solver: SDCA on the logistic dual subproblem.

    The dual of ``f`` is ``D(alpha) = (1/n) sum_i H(y_i alpha_i) - (lam/2)|w(alpha)|^2``,
    ``H(b) = -b log b - (1-b) log(1-b)`` (``b = y_i alpha_i in [0, 1]``),
    ``w(alpha) = (1/(lam n)) sum_i alpha_i x_i``. Node ``k`` maximises the CoCoA+ subproblem
    (Ma et al. 2015, eq. (10))::

        (1/n) sum_{i in P_k} H(y_i (alpha_i + da_i)) - (1/n) w^T X_k^T da
            - (sigma' / (2 lam n^2)) |X_k^T da|^2

    one coordinate at a time, exactly (up to ``tol``), with safeguarded Newton steps in
    ``logit(y_i alpha_i)``; the coordinate sees ``v = w + sigma' d_w``.

    Parameters
    ----------
    X : scipy sparse matrix (n_k, d)
    y : ndarray (n_k,)
        Labels in {-1, +1}.
    alpha : ndarray (n_k,)
        The node's committed dual variables, ``y * alpha`` in ``[0, 1]`` (start: zeros).
        Not modified.
    w : ndarray (d,)
        The server's ``w = w(alpha)`` (all nodes' alphas).
    lam : float
        ``lam > 0``.
    n : int
        The global number of rows ``n``.
    sigma_prime : float
        ``sigma' = gamma K``; CoCoA+ (adding, ``gamma = 1``) uses ``K``.
    order : array of int
        Coordinates visited (``coordinate_order(seed, task_id, round, n_k)`` for one pass).
    max_newton, tol
        Newton iterations per coordinate (at most) and the tolerance on the optimality
        condition.

    Returns
    -------
    d_alpha : ndarray (n_k,)
        The change of the node's dual variables (commit ``alpha += d_alpha`` when accepted).
    d_w : ndarray (d,)
        ``X_k^T d_alpha / (lam n)``, sent to the server (:func:`cocoa_plus_aggregate`).
    """
    X = _as_csr(X)
    n_k, d = X.shape
    ya = _as_labels(y, n_k)
    al = _as_vector(alpha, n_k, "alpha")
    b = ya * al
    if np.any(b < -1e-12) or np.any(b > 1.0 + 1e-12):
        raise ValueError("alpha must satisfy 0 <= y * alpha <= 1")
    wa = _as_vector(w, d, "w")
    lam = _positive(lam, "lam")
    sigma_prime = _positive(sigma_prime, "sigma_prime")
    if int(n) < max(n_k, 1):
        raise ValueError(f"n must be >= n_k = {n_k} (the global row count), got {n}")
    o = _as_order(order, n_k)
    d_alpha = np.zeros(n_k)
    if n_k == 0 or o.size == 0:
        return d_alpha, np.zeros(d)
    sqnorm = np.asarray(X.multiply(X).sum(axis=1), dtype=np.float64).reshape(-1)
    scale = sigma_prime / (lam * int(n))
    v = wa.copy()
    data = np.ascontiguousarray(X.data, dtype=np.float64)
    _cocoa_kernel(X.indptr, X.indices, data, ya, al, sqnorm, o, scale, int(max_newton),
                  float(tol), d_alpha, v)
    d_w = np.asarray(X.T @ d_alpha, dtype=np.float64).reshape(-1) / (lam * int(n))
    return d_alpha, d_w


def clip_dual_step(d_alpha: np.ndarray, d_w: np.ndarray,
                   clip: float) -> tuple[np.ndarray, np.ndarray, float]:
    """A device's CoCoA+ step scaled so that ``|d_w|_2 <= clip`` (client-level DP,
    ``client-clip``): ``(s d_alpha, s d_w, s)`` with ``s = min(1, clip / |d_w|)`` (the
    arrays themselves when ``s = 1``).

    Scaling both by the same ``s`` in [0, 1] keeps what CoCoA+ needs: ``d_w = X^T d_alpha /
    (lam n)`` is linear in ``d_alpha``, so the device's share of ``w(alpha)`` stays its
    image; ``alpha + s d_alpha`` lies between two feasible points (``y alpha`` in [0, 1] is
    convex), so it is feasible; and the local subproblem is concave, so the scaled step
    improves it at least ``s`` times as much as the full one.

    Raises
    ------
    ValueError
        Unless ``clip`` is a finite number > 0.
    """
    if isinstance(clip, bool) or not isinstance(clip, int | float) \
            or not np.isfinite(clip) or clip <= 0:
        raise ValueError(f"dp-clip must be a finite number > 0, got {clip!r}")
    size = float(np.linalg.norm(d_w))
    if size <= clip:
        return d_alpha, d_w, 1.0
    scale = float(clip) / size
    return d_alpha * scale, d_w * scale, scale


def cocoa_plus_aggregate(w: Any, d_w_sum: Any, gamma: float = 1.0) -> np.ndarray:
    """Server-side CoCoA+ update ``w + gamma * sum_k d_w_k`` (CoCoA+: ``gamma = 1``)."""
    wa = np.asarray(w, dtype=np.float64).reshape(-1)
    return wa + float(gamma) * _as_vector(d_w_sum, wa.shape[0], "d_w_sum")


def primal_from_dual(X: Any, alpha: Any, lam: float, n: int) -> np.ndarray:
    """A node's share ``X_k^T alpha_k / (lam n)`` of ``w(alpha)`` (sum over nodes)."""
    X = _as_csr(X)
    al = _as_vector(alpha, X.shape[0], "alpha")
    return np.asarray(X.T @ al, dtype=np.float64).reshape(-1) / (float(lam) * int(n))


def logistic_dual_sum(y: Any, alpha: Any) -> float:
    """Node-side ``sum_i H(y_i alpha_i)`` (binary entropy, ``0 log 0 = 0``) for the dual."""
    ya = np.asarray(y, dtype=np.float64).reshape(-1)
    b = np.clip(ya * np.asarray(alpha, dtype=np.float64).reshape(-1), 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -(np.where(b > 0, b * np.log(b), 0.0) + np.where(b < 1, (1 - b) * np.log1p(-b), 0.0))
    return float(np.sum(ent))


def dual_objective(w: Any, dual_sum: float, n: int, lam: float) -> float:
    """Server-side ``D(alpha) = dual_sum / n - (lam/2)|w|^2``, with ``w = w(alpha)``.

    ``global_objective(w, loss_sum, n, lam) - dual_objective(w, dual_sum, n, lam)`` is the
    duality gap (``>= 0``; 0 exactly at the optimum).
    """
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    wa = np.asarray(w, dtype=np.float64).reshape(-1)
    return float(dual_sum) / n - 0.5 * float(lam) * float(wa @ wa)
