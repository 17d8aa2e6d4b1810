"""DANE (Algorithm 2) with SVRG epochs as the local solver (see :mod:`fmtl_flower.core.fsvrg`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from fmtl_flower.core.rng import (
    TAG_DANE_EPOCH,
    coordinate_order,
)

from .logistic import (
    _as_csr,
    _as_order,
    _as_vector,
    _pass_inputs,
    _positive,
    local_loss_grad_sums,
)
from .svrg import (
    _run_pass,
)


def default_dane_step(X: Any, lam: float, mu: float = 0.0) -> float:
    """``1 / (4 L_max)``, ``L_max = max_i |x_i|^2/4 + lam + mu`` (SVRG's safe stepsize)."""
    X = _as_csr(X)
    sq = np.asarray(X.multiply(X).sum(axis=1)).reshape(-1)
    lmax = (0.25 * float(sq.max()) if sq.size else 0.0) + float(lam) + float(mu)
    if lmax <= 0.0:
        raise ValueError("L_max is 0 (empty data and lam + mu = 0): no stepsize")
    return 1.0 / (4.0 * lmax)


def dane_epoch_orders(seed: int, task_id: int, server_round: int, n: int,
                      epochs: int = 1) -> list[np.ndarray]:
    """One permutation of ``0..n-1`` per SVRG epoch of :func:`dane_local_solve`.

    Epoch 0: ``coordinate_order(seed, task_id, round, n)`` (the FSVRG pass's order, so that
    Proposition 1 holds with the same seed); epoch ``e >= 1``: a permutation from
    ``default_rng([seed, task_id, round, TAG_DANE_EPOCH, e])``.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    orders = [coordinate_order(seed, task_id, server_round, n)]
    for e in range(1, int(epochs)):
        rng = np.random.default_rng([int(seed), int(task_id), int(server_round),
                                     TAG_DANE_EPOCH, e])
        orders.append(rng.permutation(n).astype(np.int64))
    return orders


def dane_local_solve(
    X: Any,
    y: Any,
    w_t: Any,
    full_grad: Any,
    *,
    lam: float,
    step: float | None = None,
    orders: Sequence[Any],
    eta: float = 1.0,
    mu: float = 0.0,
) -> np.ndarray:
    """Node-side DANE: approximately solve the local subproblem (10) with SVRG epochs.

    ``psi_k(w) = F_k(w) - (grad F_k(w_t) - eta g)^T w + (mu/2)|w - w_t|^2`` with
    ``g = grad f(w_t)``. Starting at ``w_t``, each epoch takes a snapshot ``w~`` (the current
    iterate; the first is ``w_t``, where ``grad psi_k(w_t) = eta g`` needs no local pass),
    computes ``grad psi_k(w~)`` and runs, for ``i`` in that epoch's order::

        w <- w - step ( [grad l_i(w) - grad l_i(w~)] + (lam + mu)(w - w~) + grad psi_k(w~) ).

    Parameters
    ----------
    X, y, w_t, full_grad, lam
        As for :func:`fsvrg_local_pass`.
    step : float, optional
        Constant SVRG stepsize; default :func:`default_dane_step` of the node's data.
    orders : sequence of index arrays
        One per epoch (:func:`dane_epoch_orders`).
    eta, mu : float
        DANE's parameters (paper defaults ``eta = 1``, ``mu = 0``).

    Returns
    -------
    w_k : ndarray (d,)
        The approximate minimiser of ``psi_k`` sent to the server (:func:`dane_aggregate`).
    """
    X, ya, wt, g, lam = _pass_inputs(X, y, w_t, full_grad, lam)
    n_k, d = X.shape
    mu = _positive(mu, "mu", allow_zero=True)
    eta = float(eta)
    os_ = [_as_order(o, n_k, f"orders[{e}]") for e, o in enumerate(orders)]
    if not os_:
        raise ValueError("orders must hold at least one epoch")
    w = wt.copy()
    if n_k == 0:
        return w
    step = default_dane_step(X, lam, mu) if step is None else _positive(step, "step")
    reg = lam + mu

    def local_grad(v: np.ndarray) -> np.ndarray:
        _, gs = local_loss_grad_sums(X, ya, v)
        return gs / n_k + lam * v

    grad_fk_t = None
    for e, o in enumerate(os_):
        snap = w.copy()
        if e == 0:
            grad_psi = eta * g
        else:
            if grad_fk_t is None:
                grad_fk_t = local_grad(wt)
            grad_psi = local_grad(snap) - grad_fk_t + eta * g + mu * (snap - wt)
        if o.size:
            _run_pass(X, ya, o, snap, None, step, reg, grad_psi - reg * snap, w)
    return w


def dane_aggregate(local_models: Iterable[Any]) -> np.ndarray:
    """Server-side DANE aggregation (Algorithm 2, line 5): ``(1/K) sum_k w_k``."""
    acc: np.ndarray | None = None
    count = 0
    for w_k in local_models:
        wk = np.asarray(w_k, dtype=np.float64).reshape(-1)
        acc = wk.copy() if acc is None else acc + _as_vector(wk, acc.shape[0], "local model")
        count += 1
    if acc is None:
        raise ValueError("no local models")
    return acc / count
