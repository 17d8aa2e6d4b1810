"""The problem of the FSVRG paper: L2-regularised logistic regression on sparse CSR rows;
the argument checks, the node-side loss and gradient sums, their server-side combination,
the evaluation (see :mod:`fmtl_flower.core.fsvrg`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import scipy.sparse as sp


def _as_csr(X: Any, name: str = "X") -> sp.csr_matrix:
    """``X`` as a float64 CSR matrix (no copy when it already is one)."""
    if not sp.issparse(X):
        arr = np.asarray(X)
        if arr.ndim != 2:
            raise ValueError(f"{name} must be a 2-D (sparse) matrix, got shape {arr.shape}")
        X = arr
    Xc = sp.csr_matrix(X, dtype=np.float64)
    if not np.all(np.isfinite(Xc.data)):
        raise ValueError(f"{name} has non-finite entries")
    return Xc


def _as_labels(y: Any, n: int, name: str = "y") -> np.ndarray:
    ya = np.ascontiguousarray(np.asarray(y, dtype=np.float64).reshape(-1))
    if ya.shape[0] != n:
        raise ValueError(f"{name} has {ya.shape[0]} labels but X has {n} rows")
    if ya.size and not np.all(np.abs(ya) == 1.0):
        bad = np.unique(ya[np.abs(ya) != 1.0])[:5]
        raise ValueError(f"{name} must be in {{-1, +1}}, found {bad.tolist()}")
    return ya


def _as_vector(v: Any, d: int, name: str) -> np.ndarray:
    va = np.ascontiguousarray(np.asarray(v, dtype=np.float64).reshape(-1))
    if va.shape[0] != d:
        raise ValueError(f"{name} must have length {d}, got {va.shape[0]}")
    if not np.all(np.isfinite(va)):
        raise ValueError(f"{name} has non-finite entries")
    return va


def _as_order(order: Any, n: int, name: str = "order") -> np.ndarray:
    o = np.ascontiguousarray(np.asarray(order).reshape(-1))
    if o.size and o.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer row indices, got dtype {o.dtype}")
    o = o.astype(np.int64, copy=False)
    if o.size and (o.min() < 0 or o.max() >= n):
        raise ValueError(f"{name} must index rows 0..{n - 1}, got values in "
                         f"[{o.min()}, {o.max()}]")
    return o


def _positive(value: float, name: str, *, allow_zero: bool = False) -> float:
    v = float(value)
    ok = v >= 0.0 if allow_zero else v > 0.0
    if not (math.isfinite(v) and ok):
        raise ValueError(f"{name} must be finite and {'>=' if allow_zero else '>'} 0, "
                         f"got {value!r}")
    return v


def _pass_inputs(X: Any, y: Any, w_t: Any, full_grad: Any, lam: float
                 ) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray, np.ndarray, float]:
    """The checked inputs every local pass starts from: ``(X, y, w_t, full_grad, lam)``
    (lam >= 0)."""
    X = _as_csr(X)
    n_k, d = X.shape
    return (X, _as_labels(y, n_k), _as_vector(w_t, d, "w_t"),
            _as_vector(full_grad, d, "full_grad"), _positive(lam, "lam", allow_zero=True))


def _csr_rows(indptr: np.ndarray, indices: np.ndarray, data: np.ndarray, order: np.ndarray):
    """The numpy kernels' row loop: ``(i, columns, values)`` of CSR row ``i`` for ``i`` in
    ``order``, and whether ``v[columns] += ...`` must go entry by entry (some row lists a
    column twice: a non-canonical matrix; the compiled kernels add both entries)."""
    rows = np.repeat(np.arange(indptr.shape[0] - 1), np.diff(indptr))
    keys = rows.astype(np.int64) * (int(indices.max(initial=0)) + 1) + indices
    repeated = np.unique(keys).shape[0] != keys.shape[0]
    bounds = indptr.tolist()

    def add(v: np.ndarray, cols: np.ndarray, values: np.ndarray) -> None:
        if repeated:
            np.add.at(v, cols, values)
        else:
            v[cols] += values

    def rows_of() -> Any:
        for i in order.tolist():
            start, stop = bounds[i], bounds[i + 1]
            yield i, indices[start:stop], data[start:stop]

    return rows_of(), add


def _margins(X: sp.csr_matrix, w: np.ndarray) -> np.ndarray:
    return np.asarray(X @ w, dtype=np.float64).reshape(-1)


def _loss_derivative(y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """``d/dz log(1 + exp(-y z)) = -y sigmoid(-y z)``, elementwise and stable."""
    t = y * z
    # sigmoid(-t) = exp(-logaddexp(0, t)); exact to rounding for every t
    return -y * np.exp(-np.logaddexp(0.0, t))


def local_loss_grad_sums(X: Any, y: Any, w: Any) -> tuple[float, np.ndarray]:
    """Node-side: ``sum_i l_i(w)`` and ``sum_i grad l_i(w)`` over the node's rows.

    No regulariser and no division: the server sums these over nodes and calls
    :func:`global_objective` / :func:`global_gradient`. Also DANE's and FSVRG's full-gradient
    message, and GD's only message.

    Parameters
    ----------
    X : scipy sparse matrix (n_k, d)
        The node's rows (converted to float64 CSR).
    y : ndarray (n_k,)
        Labels in {-1, +1}.
    w : ndarray (d,)
        The current global model.

    Returns
    -------
    loss_sum : float
        ``sum_i log(1 + exp(-y_i x_i^T w))`` (0 for an empty node).
    grad_sum : ndarray (d,)
        ``sum_i -y_i sigmoid(-y_i x_i^T w) x_i``.
    """
    X = _as_csr(X)
    ya = _as_labels(y, X.shape[0])
    wa = _as_vector(w, X.shape[1], "w")
    z = _margins(X, wa)
    loss = float(np.sum(np.logaddexp(0.0, -ya * z)))
    grad = np.asarray(X.T @ _loss_derivative(ya, z), dtype=np.float64).reshape(-1)
    return loss, grad


def global_objective(w: Any, loss_sum: float, n: int, lam: float) -> float:
    """Server-side: ``f(w) = loss_sum/n + (lam/2)|w|^2`` from the summed node loss sums."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    wa = np.asarray(w, dtype=np.float64).reshape(-1)
    return float(loss_sum) / n + 0.5 * float(lam) * float(wa @ wa)


def global_gradient(w: Any, grad_sum: Any, n: int, lam: float) -> np.ndarray:
    """Server-side: ``grad f(w) = grad_sum/n + lam w`` from the summed node gradient sums."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    wa = np.asarray(w, dtype=np.float64).reshape(-1)
    g = _as_vector(grad_sum, wa.shape[0], "grad_sum")
    return g / n + float(lam) * wa


def logistic_objective(X: Any, y: Any, w: Any, lam: float) -> float:
    """Centralised ``f(w)`` on pooled data (tests, evaluation; not a federated message)."""
    X = _as_csr(X)
    loss, _ = local_loss_grad_sums(X, y, w)
    return global_objective(w, loss, X.shape[0], lam)


def logistic_loss_grad(X: Any, y: Any, w: Any, lam: float) -> tuple[float, np.ndarray]:
    """Centralised ``(f(w), grad f(w))`` on pooled data."""
    X = _as_csr(X)
    loss, grad = local_loss_grad_sums(X, y, w)
    n = X.shape[0]
    return global_objective(w, loss, n, lam), global_gradient(w, grad, n, lam)


def local_error_count(X: Any, y: Any, w: Any) -> tuple[int, int]:
    """Node-side evaluation: ``(#{i : sign(x_i^T w) != y_i}, n_k)``, with sign(0) = -1.

    The server sums both over nodes for the pooled test error (the paper's Figure 2, right).
    """
    X = _as_csr(X)
    ya = _as_labels(y, X.shape[0])
    z = _margins(X, _as_vector(w, X.shape[1], "w"))
    return int(np.sum(np.where(z > 0.0, 1.0, -1.0) != ya)), int(X.shape[0])


def relative_suboptimality(value: float, optimum: float) -> float:
    """``(f(w) - f*) / |f*|``, the convergence measure used for FSVRG (``f* > 0`` here)."""
    if optimum == 0.0:
        raise ValueError("optimum must be nonzero")
    return (float(value) - float(optimum)) / abs(float(optimum))
