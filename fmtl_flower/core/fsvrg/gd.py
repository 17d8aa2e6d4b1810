"""Distributed gradient descent (one round trip a round) and its default step 1/L, L from a
federated power iteration on the pooled Gram operator (see :mod:`fmtl_flower.core.fsvrg`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fmtl_flower.core.rng import (
    TAG_GD_POWER,
)

from .logistic import (
    _as_csr,
    _as_vector,
    _positive,
)


def gd_step(w: Any, grad: Any, step: float) -> np.ndarray:
    """Server-side gradient descent step ``w - step * grad``."""
    wa = np.asarray(w, dtype=np.float64).reshape(-1)
    return wa - _positive(step, "step") * _as_vector(grad, wa.shape[0], "grad")


#: Power iteration for GD's ``L`` stops when the estimate grows by less than this (relative).
GD_POWER_TOL = 1e-2


#: At most this many power-iteration round trips for GD's ``L``.
GD_POWER_MAX_ITER = 10


def local_gram_product(X: Any, v: Any) -> np.ndarray:
    """Node-side: ``X_k^T (X_k v)``, the node's share of the pooled Gram operator at ``v``."""
    X = _as_csr(X)
    va = _as_vector(v, X.shape[1], "v")
    return np.asarray(X.T @ (X @ va), dtype=np.float64).reshape(-1)


def gram_power_start(seed: int, dim: int) -> np.ndarray:
    """The power iteration's start: a unit Gaussian vector from ``[seed, TAG_GD_POWER]``."""
    v = np.random.default_rng([int(seed), TAG_GD_POWER]).normal(size=int(dim))
    return v / np.linalg.norm(v)


def power_estimate(v: Any, u: Any) -> tuple[float, np.ndarray]:
    """One power-iteration step for a PSD ``A`` from a unit ``v`` and ``u = A v``.

    Returns ``(|u|^2 / (v . u), u / |u|)``: the Rayleigh quotient of ``A`` at ``A^(1/2) v``
    (a lower bound on ``lambda_max(A)``, at least ``v . u``) and the next unit vector;
    ``(0, v)`` when ``u = 0``.
    """
    va = np.asarray(v, dtype=np.float64).reshape(-1)
    ua = _as_vector(u, va.shape[0], "u")
    vu = float(va @ ua)
    if vu <= 0.0:
        return 0.0, va
    uu = float(ua @ ua)
    return uu / vu, ua / math.sqrt(uu)


def gd_smoothness(sigma_max_sq: float, n: int, lam: float) -> float:
    """``L = sigma_max(X)^2 / (4n) + lam``, the smoothness constant of ``f`` (GD's step 1/L)."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    return float(sigma_max_sq) / (4.0 * n) + float(lam)
