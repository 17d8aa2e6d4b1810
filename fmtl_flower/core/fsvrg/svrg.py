"""FSVRG (Algorithm 4) and naive FSVRG (Algorithm 3): the SVRG-type local pass, compiled over
CSR rows with the implicit dense part, and the server's aggregations (see
:mod:`fmtl_flower.core.fsvrg`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import scipy.sparse as sp

from fmtl_flower.core.jit import kernel, steps_work
from fmtl_flower.core.rng import (
    TAG_UNIFORM_SAMPLE,
)

from .logistic import (
    _as_csr,
    _as_labels,
    _as_order,
    _as_vector,
    _csr_rows,
    _margins,
    _pass_inputs,
    _positive,
)

#: ``alpha`` below this in the implicit iterate ``w = alpha v + beta G`` triggers a rescale.
_RESCALE_BELOW = 1e-120


@kernel(inline="always")
def _dloss(yi, z):  # pragma: no cover - compiled
    """``d/dz log(1 + exp(-yi z)) = -yi sigmoid(-yi z)``, stable."""
    t = yi * z
    if t > 0.0:
        e = math.exp(-t)
        return -yi * e / (1.0 + e)
    return -yi / (1.0 + math.exp(t))


def _svrg_pass_numpy(indptr, indices, data, y, order, z_snap, s, use_s, step, reg, G, w):
    """:func:`_svrg_pass_kernel` with numpy: one Python step per row of ``order``, the row's
    entries as numpy slices."""
    rho = 1.0 - step * reg
    alpha = 1.0
    beta = 0.0
    v = w
    rows, add = _csr_rows(indptr, indices, data, order)
    ys, zs = y.tolist(), z_snap.tolist()
    for i, cols, vals in rows:
        z = alpha * float(vals @ v[cols]) + beta * float(vals @ G[cols])
        yi = ys[i]
        gi = _dloss(yi, z) - _dloss(yi, zs[i])
        alpha *= rho
        beta = rho * beta - step
        if alpha < _RESCALE_BELOW:
            v *= alpha
            alpha = 1.0
        if gi != 0.0:
            c = -step * gi / alpha
            add(v, cols, c * s[cols] * vals if use_s else c * vals)
    w[:] = alpha * v + beta * G


#: A numpy FSVRG step (two sparse dot products, two loss derivatives, a scatter) costs about
#: this many numpy SDCA steps (:data:`fmtl_flower.core.jit.STEP_US`; measured 4.95 by
#: ``benchmarks/kernel_breakeven.py``).
_PASS_STEPS = 5.0


@kernel(_svrg_pass_numpy, boundscheck=False,
        work=lambda indptr, indices, data, y, order, *_: _PASS_STEPS * steps_work(
            order.shape[0], data.shape[0] / max(indptr.shape[0] - 1, 1)))
def _svrg_pass_kernel(indptr, indices, data, y, order, z_snap, s, use_s, step, reg, G,
                      w):  # pragma: no cover - compiled
    """In place on ``w``: for i in order,
    ``w <- w - step (s * (l'_i(w) - l'_i(snap)) x_i + reg w + G)``.

    ``z_snap[i] = x_i^T snap``. The iterate is kept as ``alpha v + beta G`` (``v`` aliases
    ``w``), so the dense part costs O(1) per step.
    """
    d = w.shape[0]
    rho = 1.0 - step * reg
    alpha = 1.0
    beta = 0.0
    v = w
    for t in range(order.shape[0]):
        i = order[t]
        start = indptr[i]
        stop = indptr[i + 1]
        xv = 0.0
        xg = 0.0
        for p in range(start, stop):
            j = indices[p]
            xv += data[p] * v[j]
            xg += data[p] * G[j]
        z = alpha * xv + beta * xg
        yi = y[i]
        gi = _dloss(yi, z) - _dloss(yi, z_snap[i])
        alpha *= rho
        beta = rho * beta - step
        if alpha < _RESCALE_BELOW:
            for j in range(d):
                v[j] *= alpha
            alpha = 1.0
        if gi != 0.0:
            c = -step * gi / alpha
            if use_s:
                for p in range(start, stop):
                    j = indices[p]
                    v[j] += c * s[j] * data[p]
            else:
                for p in range(start, stop):
                    v[indices[p]] += c * data[p]
    for j in range(d):
        w[j] = alpha * v[j] + beta * G[j]


def _run_pass(X: sp.csr_matrix, y: np.ndarray, order: np.ndarray, snap: np.ndarray,
              s: np.ndarray | None, step: float, reg: float, G: np.ndarray,
              w: np.ndarray) -> None:
    if not (step * reg < 1.0):
        raise ValueError(f"step * regulariser must be < 1, got {step} * {reg}")
    z_snap = _margins(X, snap)
    use_s = s is not None
    s_arr = s if s is not None else np.ones(1)
    data = np.ascontiguousarray(X.data, dtype=np.float64)
    _svrg_pass_kernel(X.indptr, X.indices, data, y, order, z_snap, s_arr, use_s, float(step),
                      float(reg), G, w)


def _local_pass(X: Any, y: Any, w_t: Any, full_grad: Any, lam: float, h: float, order: Any,
                s: Any, *, per_row: bool) -> np.ndarray:
    """The FSVRG and naive FSVRG passes: checks, then one pass from ``w_t`` over ``order``
    with the step ``h / n_k`` (``per_row``, FSVRG) or ``h`` (naive)."""
    X, ya, wt, g, lam = _pass_inputs(X, y, w_t, full_grad, lam)
    n_k, d = X.shape
    h = _positive(h, "h")
    o = _as_order(order, n_k)
    s_arr = None if s is None else _as_vector(s, d, "s")
    w = wt.copy()
    if n_k == 0 or o.size == 0:
        return w
    _run_pass(X, ya, o, wt, s_arr, h / n_k if per_row else h, lam, g - lam * wt, w)
    return w


def fsvrg_local_pass(
    X: Any,
    y: Any,
    w_t: Any,
    full_grad: Any,
    *,
    lam: float,
    h: float,
    s: Any,
    order: Any,
) -> np.ndarray:
    """Node-side FSVRG local pass (Algorithm 4, lines 5-9).

    ``w_k = w_t``, then for ``i`` in ``order`` (normally
    ``coordinate_order(seed, task_id, round, n_k)``, one permutation of the rows)::

        w_k <- w_k - (h/n_k) ( s * [grad l_i(w_k) - grad l_i(w_t)] + lam (w_k - w_t) + g )

    with ``g = grad f(w_t)`` from the server. ``s`` scales the loss part only (see the module
    docstring).

    Parameters
    ----------
    X : scipy sparse matrix (n_k, d)
        The node's rows.
    y : ndarray (n_k,)
        Labels in {-1, +1}.
    w_t : ndarray (d,)
        The server's model.
    full_grad : ndarray (d,)
        ``grad f(w_t)`` (:func:`global_gradient`), regulariser included.
    lam : float
        ``lam >= 0``.
    h : float
        The global stepsize ``h > 0``; the local one is ``h_k = h / n_k``.
    s : ndarray (d,) or None
        The diagonal of ``S_k`` (:func:`node_scaling`); ``None`` means ``S_k = I``.
    order : array of int (any length)
        Row indices visited, in order.

    Returns
    -------
    w_k : ndarray (d,)
        The node's final iterate (the node sends it, or ``w_k - w_t``).
    """
    return _local_pass(X, y, w_t, full_grad, lam, h, order, s, per_row=True)


def naive_fsvrg_local_pass(
    X: Any,
    y: Any,
    w_t: Any,
    full_grad: Any,
    *,
    lam: float,
    h: float,
    order: Any,
) -> np.ndarray:
    """Node-side naive FSVRG (Algorithm 3, lines 5-9): ``S_k = I``, stepsize ``h``.

    ``w_k <- w_k - h (grad f_i(w_k) - grad f_i(w_t) + grad f(w_t))`` for ``i`` in ``order``
    (Algorithm 3 samples ``m`` rows uniformly at random: :func:`uniform_sample_order`).
    """
    return _local_pass(X, y, w_t, full_grad, lam, h, order, None, per_row=False)


def fsvrg_local_pass_reference(
    X: Any,
    y: Any,
    w_t: Any,
    full_grad: Any,
    *,
    lam: float,
    h: float,
    s: Any,
    order: Any,
) -> np.ndarray:
    """The same pass as :func:`fsvrg_local_pass`, as a plain scipy-per-row loop.

    Each step slices the row from the CSR matrix and updates the dense iterate (``O(d)`` per
    step). For tests and the speed benchmark only.
    """
    X = _as_csr(X)
    n_k, d = X.shape
    ya = _as_labels(y, n_k)
    wt = _as_vector(w_t, d, "w_t")
    g = _as_vector(full_grad, d, "full_grad")
    o = _as_order(order, n_k)
    sv = np.ones(d) if s is None else _as_vector(s, d, "s")
    hk = float(h) / max(n_k, 1)
    w = wt.copy()
    for i in o:
        row = X.getrow(int(i))
        idx, vals = row.indices, row.data
        z = float(vals @ w[idx])
        z_t = float(vals @ wt[idx])
        yi = ya[i]
        gi = -yi / (1.0 + math.exp(yi * z)) + yi / (1.0 + math.exp(yi * z_t))
        w_new = w - hk * (lam * (w - wt) + g)
        np.add.at(w_new, idx, -hk * gi * sv[idx] * vals)
        w = w_new
    return w


def fsvrg_aggregate(
    w_t: Any,
    local_models: Iterable[Any],
    sizes: Iterable[int],
    a: Any,
    *,
    n: int | None = None,
) -> np.ndarray:
    """Server-side FSVRG aggregation (Algorithm 4, line 11).

    ``w_{t+1} = w_t + A sum_k (n_k/n) (w_k - w_t)``. Both iterables are consumed in step (a
    generator works: only ``O(d)`` is held).

    Parameters
    ----------
    w_t : ndarray (d,)
    local_models : iterable of ndarray (d,)
        The nodes' ``w_k``.
    sizes : iterable of int
        Their ``n_k``, in the same order.
    a : ndarray (d,)
        The diagonal of ``A`` (:attr:`FeatureStats.a`).
    n : int, optional
        The ``n`` of ``n_k/n``. Default: the sum of ``sizes`` (equal to the paper's ``n``
        when every node replies). Pass :attr:`FeatureStats.n` to keep the paper's weights
        when some nodes drop (a missing node then contributes no change).
    """
    wt = np.asarray(w_t, dtype=np.float64).reshape(-1)
    d = wt.shape[0]
    av = _as_vector(a, d, "a")
    acc = np.zeros(d)
    total = 0
    for w_k, n_k in zip(local_models, sizes, strict=True):
        n_k = int(n_k)
        if n_k < 0:
            raise ValueError(f"sizes must be >= 0, got {n_k}")
        acc += n_k * (_as_vector(w_k, d, "local model") - wt)
        total += n_k
    denom = total if n is None else int(n)
    if denom <= 0:
        return wt.copy()
    return wt + av * (acc / denom)


def naive_fsvrg_aggregate(w_t: Any, local_models: Iterable[Any]) -> np.ndarray:
    """Server-side naive FSVRG aggregation (Algorithm 3, line 11): ``w_t + mean(w_k - w_t)``."""
    wt = np.asarray(w_t, dtype=np.float64).reshape(-1)
    acc = np.zeros_like(wt)
    count = 0
    for w_k in local_models:
        acc += _as_vector(w_k, wt.shape[0], "local model") - wt
        count += 1
    return wt.copy() if count == 0 else wt + acc / count


def uniform_sample_order(seed: int, task_id: int, server_round: int, n: int,
                         m: int | None = None) -> np.ndarray:
    """``m`` row indices drawn uniformly with replacement (Algorithm 3; ``m`` defaults to n).

    From ``np.random.default_rng([seed, task_id, round, TAG_UNIFORM_SAMPLE])``.
    """
    m = n if m is None else int(m)
    if n < 0 or m < 0:
        raise ValueError(f"n and m must be >= 0, got {n}, {m}")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng([int(seed), int(task_id), int(server_round), TAG_UNIFORM_SAMPLE])
    return rng.integers(0, n, size=m, dtype=np.int64)
