"""OFMTL's server side with Sigma in factored form, for many tasks (m >> d).

The dense functions of :mod:`fmtl_flower.core.ofmtl` (:func:`~.ofmtl.extend_sigma`,
:func:`~.ofmtl.omega_from_sigma`, :func:`~.ofmtl.newcomer_server_quantities`,
:func:`~.ofmtl.ofmtl_omega_step`) hold m x m arrays and take an O(m^3) eigendecomposition per
newcomer step. Their counterparts here keep Sigma and Omega = Sigma^-1 as
:class:`fmtl_flower.core.factored.FactoredMatrix` (V diag(s) V^T + c I, V orthonormal m x r)
and give the same values to rounding:

* the extension blockdiag(m/(m+1) Sigma, 1/(m+1)) pads V with a zero row and adds e_{m+1}
  as one more column: O(m r);
* Omega = Sigma^-1 by :meth:`FactoredMatrix.inverse` (Woodbury, shares V): O(r);
* the newcomer's (omega, c) from the last row of Omega's factor: O(m r + m d);
* the Omega-step is MOCHA's factored closed form
  (:func:`fmtl_flower.core.factored.sigma_probabilistic_factored`, as
  :class:`~fmtl_flower.core.factored.FactoredProbabilistic` uses it): O(m d^2), r <= min(d, m).

So one newcomer round trip costs O(m d^2) flops and O(m d) memory; no m x m array is formed.
Between Omega-steps the extension raises r by one (a newcomer served with ``outer = 1``
never triggers one; the next Omega-step or MOCHA retraining brings r back to <= d).

:class:`OFMTLServerOps` bundles either set of functions, so a driver
(:func:`fmtl_flower.core.ofmtl.add_task`, :class:`fmtl_flower.strategies.ofmtl.OFMTL`) runs the
same protocol on both representations (:func:`server_ops`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .factored import FactoredMatrix, sigma_probabilistic_factored
from .ofmtl_server import (
    _TRACE_TOL,
    _positive,
    extend_sigma,
    frozen_models,
    newcomer_server_quantities,
    ofmtl_omega_step,
    omega_from_sigma,
    omega_step_models,
)
from .omega import DEFAULT_OMEGA_EPS

__all__ = [
    "OFMTLServerOps",
    "extend_sigma_factored",
    "newcomer_server_quantities_factored",
    "ofmtl_omega_step_factored",
    "omega_from_sigma_factored",
    "server_ops",
]


def _factor(A: Any, arg: str) -> FactoredMatrix:
    if not isinstance(A, FactoredMatrix):
        raise TypeError(f"{arg} must be a FactoredMatrix, got {type(A).__name__}")
    return A


def extend_sigma_factored(Sigma: FactoredMatrix) -> FactoredMatrix:
    """:func:`fmtl_flower.core.ofmtl.extend_sigma` for a factored Sigma, in O(m r).

    With a = m / (m + 1), blockdiag(a Sigma, 1/(m+1)) =
    [[V, 0], [0, 1]] diag(a s, 1/(m+1) - a c) [[V, 0], [0, 1]]^T + a c I_{m+1}: V gets a
    zero row and e_{m+1} as one more orthonormal column, s and c are scaled by a, and the new
    column's weight 1/(m+1) - a c cancels the a c that the identity part adds at (m, m), so
    the new diagonal entry (and eigenvalue) is 1/(m+1) (computed as a c + (1/(m+1) - a c):
    exact when c = 0, else to one ulp -- no float weight gives it exactly when the sum is a
    rounding tie). m = 0 gives [[1]] (V = [[1]], s = [1], c = 0).

    Parameters
    ----------
    Sigma : FactoredMatrix (m x m)
        Positive semidefinite with unit trace (tolerance 1e-8); V orthonormal (not checked).

    Returns
    -------
    FactoredMatrix ((m + 1) x (m + 1), rank r + 1)

    Raises
    ------
    TypeError
        If Sigma is not a FactoredMatrix.
    ValueError
        If Sigma's trace is not 1 or it has an eigenvalue below -1e-12 max(1, |eigenvalues|).
    """
    Sigma = _factor(Sigma, "Sigma")
    m, r = Sigma.num_tasks, Sigma.rank
    if m:
        trace = Sigma.trace()
        if abs(trace - 1.0) > _TRACE_TOL:
            raise ValueError(f"Sigma must have unit trace, got {trace}")
        low, high = Sigma.min_eigenvalue(), Sigma.max_eigenvalue()
        if low < -1e-12 * max(1.0, abs(low), abs(high)):
            raise ValueError(f"Sigma must be positive semidefinite, smallest eigenvalue {low}")
    scale = m / (m + 1)
    c = Sigma.c * scale
    V = np.zeros((m + 1, r + 1))
    V[:m, :r] = Sigma.V
    V[m, r] = 1.0
    s = np.empty(r + 1)
    np.multiply(Sigma.s, scale, out=s[:r])
    s[r] = 1.0 / (m + 1) - c
    return FactoredMatrix(V, s, c)


def omega_from_sigma_factored(Sigma: FactoredMatrix) -> FactoredMatrix:
    """Omega = Sigma^-1 (:meth:`FactoredMatrix.inverse`, Woodbury; the same V), O(r).

    Raises ``ValueError`` if Sigma is not positive definite (as
    :func:`fmtl_flower.core.ofmtl.omega_from_sigma`), ``TypeError`` if not factored.
    """
    Sigma = _factor(Sigma, "Sigma")
    if Sigma.num_tasks:
        low = Sigma.min_eigenvalue()
        if not low > 0:
            raise ValueError(f"Sigma must be positive definite, smallest eigenvalue {low}")
    return Sigma.inverse()


def newcomer_server_quantities_factored(W_old: np.ndarray, Omega_ext: FactoredMatrix
                                        ) -> tuple[float, np.ndarray]:
    """:func:`fmtl_flower.core.ofmtl.newcomer_server_quantities` for a factored Omega.

    With Omega = U diag(q) U^T + k I and u = U[m] (the newcomer's row of U):
    omega = k + sum_j q_j u_j^2 and c = W_old (U[:m] (q * u)) (the identity part has no
    off-diagonal entries). O(m r + m d); Omega is never formed.

    Parameters
    ----------
    W_old : ndarray of shape (d, m)
    Omega_ext : FactoredMatrix ((m + 1) x (m + 1)), Omega[m, m] > 0

    Returns
    -------
    omega : float
    c : ndarray of shape (d,)
    """
    Omega_ext = _factor(Omega_ext, "Omega_ext")
    W_old = frozen_models(W_old)
    m = W_old.shape[1]
    if Omega_ext.num_tasks != m + 1:
        raise ValueError(f"Omega_ext must be ({m + 1}, {m + 1}), got {Omega_ext.num_tasks} "
                         "tasks")
    u = Omega_ext.V[m]
    weighted = Omega_ext.s * u
    omega = _positive(Omega_ext.c + float(u @ weighted), "Omega_ext[m, m]")
    c = W_old @ (Omega_ext.V[:m] @ weighted)
    return omega, c


def ofmtl_omega_step_factored(W: np.ndarray, eps_rel: float = DEFAULT_OMEGA_EPS
                              ) -> tuple[FactoredMatrix, FactoredMatrix]:
    """:func:`fmtl_flower.core.ofmtl.ofmtl_omega_step` in factored form, O(m d^2).

    Sigma = :func:`fmtl_flower.core.factored.sigma_probabilistic_factored` (W) (MOCHA's
    factored probabilistic Omega-step), Omega = :func:`omega_from_sigma_factored` (Sigma).

    Parameters
    ----------
    W : ndarray of shape (d, m + 1)
    eps_rel : float

    Returns
    -------
    Sigma, Omega : FactoredMatrix ((m + 1) x (m + 1))
    """
    sigma = sigma_probabilistic_factored(omega_step_models(W), eps_rel)
    return sigma, omega_from_sigma_factored(sigma)


# ----------------------------------------------------------------------------- dispatch


def _dense_regulariser(W: np.ndarray, Omega: np.ndarray) -> float:
    return float(np.einsum("ij,ij->", W @ Omega, W))


def _factored_regulariser(W: np.ndarray, Omega: FactoredMatrix) -> float:
    return Omega.quad_trace(W)


class OFMTLServerOps(NamedTuple):
    """OFMTL's server steps for one representation of Sigma and Omega.

    Attributes
    ----------
    extend_sigma : Sigma (m x m) -> the extended Sigma ((m + 1) x (m + 1))
    omega_from_sigma : Sigma -> Omega = Sigma^-1
    newcomer_server_quantities : (W_old, Omega_ext) -> (omega, c)
    omega_step : (W, eps_rel) -> (Sigma, Omega)
    quad_trace : (W, Omega) -> tr(W Omega W^T)
    """

    extend_sigma: Callable[[Any], Any]
    omega_from_sigma: Callable[[Any], Any]
    newcomer_server_quantities: Callable[[np.ndarray, Any], tuple[float, np.ndarray]]
    omega_step: Callable[[np.ndarray, float], tuple[Any, Any]]
    quad_trace: Callable[[np.ndarray, Any], float]


DENSE_OPS = OFMTLServerOps(extend_sigma, omega_from_sigma, newcomer_server_quantities,
                           ofmtl_omega_step, _dense_regulariser)
FACTORED_OPS = OFMTLServerOps(extend_sigma_factored, omega_from_sigma_factored,
                              newcomer_server_quantities_factored, ofmtl_omega_step_factored,
                              _factored_regulariser)


def server_ops(Sigma: np.ndarray | FactoredMatrix) -> OFMTLServerOps:
    """The functions for Sigma's representation: factored for a :class:`FactoredMatrix`,
    else the dense ones of :mod:`fmtl_flower.core.ofmtl` (unchanged)."""
    return FACTORED_OPS if isinstance(Sigma, FactoredMatrix) else DENSE_OPS


__all__ += ["DENSE_OPS", "FACTORED_OPS"]
