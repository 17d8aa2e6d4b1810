"""OFMTL's server steps on a dense task covariance (m x m arrays, O(m^3) per step).

The newcomer's side and the driver :func:`~fmtl_flower.core.ofmtl.add_task` live in
:mod:`fmtl_flower.core.ofmtl`, the factored counterparts in
:mod:`fmtl_flower.core.ofmtl_factored`; both import these, so neither imports the other's
importer (``ofmtl`` -> ``ofmtl_factored`` -> ``ofmtl_server``).
"""

from __future__ import annotations

import math

import numpy as np

from .omega import DEFAULT_OMEGA_EPS, sigma_probabilistic

__all__ = [
    "extend_sigma",
    "frozen_models",
    "newcomer_server_quantities",
    "ofmtl_omega_step",
    "omega_from_sigma",
    "omega_step_models",
]

_TRACE_TOL = 1e-8  # as ProbabilisticFormulation.set_omega


def _positive(value: float, arg: str) -> float:
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{arg} must be a finite number > 0, got {value}")
    return value


def _square_symmetric(A: np.ndarray, arg: str) -> np.ndarray:
    A = np.array(A, dtype=np.float64)
    if A.ndim != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"{arg} must be a square matrix, got shape {A.shape}")
    if not np.all(np.isfinite(A)):
        raise ValueError(f"{arg} has non-finite entries")
    scale = max(1.0, float(np.abs(A).max())) if A.size else 1.0
    if A.size and np.abs(A - A.T).max() > 1e-10 * scale:
        raise ValueError(f"{arg} must be symmetric")
    return 0.5 * (A + A.T)


def extend_sigma(Sigma: np.ndarray) -> np.ndarray:
    """blockdiag(m/(m+1) Sigma, 1/(m+1)) for a new task (the authors' code, section 7.2).

    Parameters
    ----------
    Sigma : ndarray of shape (m, m)
        Symmetric positive semidefinite with unit trace (tolerance 1e-8). m = 0 (no task
        yet) gives [[1]].

    Returns
    -------
    ndarray of shape (m + 1, m + 1)
        Symmetric PSD with unit trace (positive definite if Sigma is); the new task is
        uncorrelated with the old ones.

    Raises
    ------
    ValueError
        If Sigma is not square, finite, symmetric, PSD, or has a trace other than 1.
    """
    Sigma = _square_symmetric(Sigma, "Sigma")
    m = Sigma.shape[0]
    if m:
        trace = float(np.trace(Sigma))
        if abs(trace - 1.0) > _TRACE_TOL:
            raise ValueError(f"Sigma must have unit trace, got {trace}")
        low = float(np.linalg.eigvalsh(Sigma)[0])
        if low < -1e-12 * max(1.0, float(np.abs(Sigma).max())):
            raise ValueError(f"Sigma must be positive semidefinite, smallest eigenvalue {low}")
    out = np.zeros((m + 1, m + 1))
    out[:m, :m] = Sigma * (m / (m + 1))
    out[m, m] = 1.0 / (m + 1)
    return out


def omega_from_sigma(Sigma: np.ndarray) -> np.ndarray:
    """Omega = Sigma^-1 through a symmetric eigendecomposition (exactly symmetric result).

    Raises ``ValueError`` if Sigma is not symmetric positive definite.
    """
    Sigma = _square_symmetric(Sigma, "Sigma")
    evals, evecs = np.linalg.eigh(Sigma)
    if Sigma.shape[0] and not evals[0] > 0:
        raise ValueError(f"Sigma must be positive definite, smallest eigenvalue {evals[0]}")
    omega = (evecs / evals) @ evecs.T
    return 0.5 * (omega + omega.T)


def newcomer_server_quantities(W_old: np.ndarray, Omega_ext: np.ndarray) -> tuple[float,
                                                                                np.ndarray]:
    """The server's message to the newcomer: omega = Omega[m, m], c = W_old Omega[:m, m].

    Parameters
    ----------
    W_old : ndarray of shape (d, m)
        The frozen models of the m old tasks.
    Omega_ext : ndarray of shape (m + 1, m + 1)
        The extended (or Omega-stepped) precision matrix, symmetric with Omega[m, m] > 0;
        the newcomer is its last index. For K other than lam Omega pass K / lam.

    Returns
    -------
    omega : float
    c : ndarray of shape (d,)
        sum_{t<m} Omega[t, m] w_t. Together d + 1 floats.
    """
    W_old = frozen_models(W_old)
    m = W_old.shape[1]
    Omega_ext = _square_symmetric(Omega_ext, "Omega_ext")
    if Omega_ext.shape != (m + 1, m + 1):
        raise ValueError(f"Omega_ext must have shape ({m + 1}, {m + 1}), got {Omega_ext.shape}")
    omega = _positive(Omega_ext[m, m], "Omega_ext[m, m]")
    c = W_old @ Omega_ext[:m, m]
    return omega, c


def ofmtl_omega_step(W: np.ndarray, eps_rel: float = DEFAULT_OMEGA_EPS
                     ) -> tuple[np.ndarray, np.ndarray]:
    """OFMTL's Omega-step over all m+1 columns: MOCHA's closed form, then Omega = Sigma^-1.

    Parameters
    ----------
    W : ndarray of shape (d, m + 1)
        [W_old, w_new].
    eps_rel : float
        Relative eigenvalue floor of W^T W (see :func:`sigma_probabilistic`).

    Returns
    -------
    Sigma : ndarray of shape (m + 1, m + 1)
        :func:`fmtl_flower.core.omega.sigma_probabilistic` of W (unit trace, SPD).
    Omega : ndarray of shape (m + 1, m + 1)
        Sigma^-1 (:func:`omega_from_sigma`).
    """
    sigma = sigma_probabilistic(omega_step_models(W), eps_rel)
    return sigma, omega_from_sigma(sigma)


def frozen_models(W_old: np.ndarray) -> np.ndarray:
    """``W_old`` (d, m) as float64, checked (2-D, finite); ValueError otherwise. Shared by the
    dense and factored newcomer quantities."""
    W_old = np.asarray(W_old, dtype=np.float64)
    if W_old.ndim != 2:
        raise ValueError(f"W_old must be a 2-D array (d, m), got shape {W_old.shape}")
    if not np.all(np.isfinite(W_old)):
        raise ValueError("W_old has non-finite entries")
    return W_old


def omega_step_models(W: np.ndarray) -> np.ndarray:
    """``W`` as float64, checked for an Omega-step over its m + 1 columns (2-D, at least one
    column, finite); ValueError otherwise. Shared by the dense and factored paths."""
    W = np.asarray(W, dtype=np.float64)
    if W.ndim != 2 or W.shape[1] < 1:
        raise ValueError(f"W must be a 2-D array (d, m + 1), got shape {W.shape}")
    if not np.all(np.isfinite(W)):
        raise ValueError("W has non-finite entries")
    return W
