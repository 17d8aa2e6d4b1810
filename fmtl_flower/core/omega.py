"""Task covariance matrices Sigma used by the formulations (:mod:`.formulations`).

* Sigma = I / m (Omega = m I): independent tasks, the reference code's start.
* MOCHA paper eq. (14): Sigma = (W^T W)^(1/2) / tr((W^T W)^(1/2)), the closed-form minimiser
  of tr(W Omega W^T) over {Omega > 0, tr(Omega^-1) = 1}, computed with a perturbation eps.
"""

from __future__ import annotations

import numpy as np


def sigma_identity(m: int) -> np.ndarray:
    """Sigma = I / m (Omega = m I): the independent-tasks start of the reference code."""
    if m < 1:
        raise ValueError(f"number of tasks must be >= 1, got {m}")
    return np.eye(m) / m


DEFAULT_OMEGA_EPS = 1e-3


def sigma_probabilistic(W: np.ndarray, eps_rel: float = DEFAULT_OMEGA_EPS) -> np.ndarray:
    """Omega-step of eq. (14): Sigma = (W^T W + eps I)^(1/2) / trace.

    Computed with a symmetric eigendecomposition of the Gram matrix W^T W; eigenvalues are
    clipped at 0 (round-off makes some slightly negative when m > d) and
    ``eps = eps_rel * lambda_max(W^T W)`` is added, so Sigma is positive definite with
    cond(Sigma) <= (1 / eps_rel)^(1/2). No general ``sqrtm`` and no inverse are formed.

    eps is the perturbation of the trace-norm problem of Argyriou, Evgeniou and Pontil
    ("Convex multi-task feature learning", 2008), whose alternating minimisation it makes
    well posed. With m > d, W^T W is singular and a vanishing eps (the MOCHA reference code
    floors eigenvalues at 1e-7, cond(Sigma) ~ 1e5 on small.mat) locks the next W-steps into
    the current row space of W: measured on small.mat (lambda = 1e-4, 200 rounds, an
    Omega-step every 20), eps_rel = 1e-10 / 1e-4 / 1e-3 / 1e-2 reach a primal of 13.6 / 12.2
    / 10.3 / 10.1 with sigma' = 22.9 / 18.3 / 12.4 / 7.7. The default 1e-3 keeps cond(Sigma)
    <= 32 while staying close to the unperturbed problem; ``omega-eps`` changes it.

    Parameters
    ----------
    W : ndarray of shape (d, m)
        Current models, one column per task.
    eps_rel : float
        Relative eigenvalue floor (> 0).

    Returns
    -------
    ndarray of shape (m, m)
        Symmetric positive definite Sigma with unit trace. ``I / m`` when W = 0.
    """
    return sigma_from_gram(W.T @ W, eps_rel)


def sigma_from_gram(gram: np.ndarray, eps_rel: float = DEFAULT_OMEGA_EPS) -> np.ndarray:
    """Eq. (14)'s Sigma = (G + eps I)^(1/2) / trace for a Gram matrix ``G`` (m, m) given
    directly: :func:`sigma_probabilistic` is ``sigma_from_gram(W.T @ W)``; record-level DP
    passes the Gram matrix with the releases' known noise discounted
    (:func:`fmtl_flower.core.record_dp.debiased_gram`). Negative eigenvalues are clipped at
    0, ``I / m`` when G has no positive one."""
    if eps_rel <= 0:
        raise ValueError(f"eps_rel must be > 0, got {eps_rel}")
    m = gram.shape[1]
    evals, evecs = np.linalg.eigh(gram)
    evals = np.clip(evals, 0.0, None)
    top = float(evals[-1]) if m else 0.0
    if not np.isfinite(top):
        raise FloatingPointError("the Gram matrix has non-finite eigenvalues")
    if top <= 0.0:
        return sigma_identity(m)
    roots = np.sqrt(evals + eps_rel * top)
    sigma = (evecs * (roots / roots.sum())) @ evecs.T
    return 0.5 * (sigma + sigma.T)
