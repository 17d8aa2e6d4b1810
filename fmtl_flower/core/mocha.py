"""MOCHA's server-side state and math, free of any Flower dependency.

The server keeps B = [b_1 .. b_m] (b_t = X_t^T alpha_t / n_t), Sigma and lambda, and the models
W = W(alpha) = B Sigma / lambda (design decision 2: W is always the image of the dual
variables, recomputed after every Omega-step, so duality gaps are meaningful).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .objective import regulariser_value
from .omega import DEFAULT_OMEGA_EPS, omega_step, sigma_identity, sigma_prime


@dataclass
class MochaServerState:
    """Server state of MOCHA for m tasks in d dimensions.

    Attributes
    ----------
    lam : float
        Regularisation strength lambda (> 0).
    B : ndarray of shape (d, m)
        Accumulated dual images of the committed dual variables.
    sigma : ndarray of shape (m, m)
        Task covariance Sigma (K = lambda * Sigma^-1).
    W : ndarray of shape (d, m)
        Models W(alpha) = B Sigma / lambda, kept in step with B and Sigma.
    """

    lam: float
    B: np.ndarray
    sigma: np.ndarray
    W: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        if not (np.isfinite(self.lam) and self.lam > 0):
            raise ValueError(f"lambda must be a finite number > 0, got {self.lam}")
        d, m = self.B.shape
        if self.sigma.shape != (m, m):
            raise ValueError(f"sigma must be ({m}, {m}), got {self.sigma.shape}")
        self.recompute_models()

    @classmethod
    def zeros(cls, dim: int, num_tasks: int, lam: float) -> MochaServerState:
        """alpha = 0 everywhere (B = 0, W = 0) and Sigma = I / m."""
        return cls(lam=lam, B=np.zeros((dim, num_tasks)), sigma=sigma_identity(num_tasks))

    @property
    def num_tasks(self) -> int:
        return self.B.shape[1]

    @property
    def dim(self) -> int:
        return self.B.shape[0]

    def m_diag(self) -> np.ndarray:
        """Diagonal of M = K^-1 = Sigma / lambda, one ``m_tt`` per task."""
        return np.diag(self.sigma) / self.lam

    def sigma_prime(self, mode: str = "global", gamma: float = 1.0) -> np.ndarray:
        """Per-task sigma' for the current Sigma (see :func:`omega.sigma_prime`)."""
        return sigma_prime(self.sigma, mode, gamma)

    def recompute_models(self) -> None:
        """W <- B Sigma / lambda."""
        self.W = (self.B @ self.sigma) / self.lam

    def add_updates(self, tasks: np.ndarray, delta_B: np.ndarray) -> None:
        """Add the dual-image changes of some tasks: b_t += delta_b_t, and W accordingly.

        Parameters
        ----------
        tasks : ndarray of shape (k,), int
            Distinct task indices.
        delta_B : ndarray of shape (d, k)
            Column j is the change of b_{tasks[j]}.
        """
        if len(tasks) == 0:
            return
        self.B[:, tasks] += delta_B
        self.W += (delta_B @ self.sigma[tasks, :]) / self.lam

    def reset_tasks(self, tasks: np.ndarray) -> None:
        """Set b_t = 0 (alpha_t = 0) for the given tasks and update W."""
        tasks = np.asarray(tasks, dtype=np.int64)
        if len(tasks):
            self.add_updates(tasks, -self.B[:, tasks].copy())
            self.B[:, tasks] = 0.0

    def omega_step(self, kind: str, eps_rel: float = DEFAULT_OMEGA_EPS) -> None:
        """Update Sigma by Omega-step ``kind`` for the current W, then W <- B Sigma / lambda."""
        self.sigma = omega_step(kind, self.W, self.sigma, eps_rel)
        self.recompute_models()

    def regulariser(self) -> float:
        """(1/2) tr(W K W^T) of the current consistent pair."""
        return regulariser_value(self.W, self.B)
