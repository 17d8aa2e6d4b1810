"""MOCHA's server-side state and math, free of any Flower dependency.

The server keeps B = [b_1 .. b_m] (b_t = X_t^T alpha_t / n_t) and a task-relationship
formulation (:mod:`fmtl_flower.core.formulations`) with its inverse regulariser matrix
M = K^-1, and the models W = W(alpha) = B M (design decision 2: W is always the image of the
dual variables, recomputed after every Omega-step, so duality gaps are meaningful).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .formulations import Formulation, make_formulation
from .objective import regulariser_value


@dataclass
class MochaServerState:
    """Server state of MOCHA for m tasks in d dimensions.

    Attributes
    ----------
    B : ndarray of shape (d, m)
        Accumulated dual images of the committed dual variables.
    formulation : Formulation
        The regulariser R(W) = (1/2) tr(W K W^T) (+ terms without W) and its Omega-step.
    M : ndarray of shape (m, m)
        K^-1 for the current Omega.
    W : ndarray of shape (d, m)
        Models W(alpha) = B M, kept in step with B and M.
    """

    B: np.ndarray
    formulation: Formulation
    M: np.ndarray = field(init=False)
    W: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        if self.B.ndim != 2 or self.B.shape[1] != self.formulation.num_tasks:
            raise ValueError(f"B must be (d, {self.formulation.num_tasks}), got {self.B.shape}")
        self.M = self.formulation.inverse_matrix()
        self.recompute_models()

    @classmethod
    def zeros(cls, dim: int, formulation: Formulation) -> MochaServerState:
        """alpha = 0 everywhere (B = 0, W = 0), Omega at the formulation's start."""
        return cls(B=np.zeros((dim, formulation.num_tasks)), formulation=formulation)

    @classmethod
    def zeros_for(cls, dim: int, num_tasks: int, omega: str = "identity", *, lam: float,
                  **options) -> MochaServerState:
        """Shorthand: :meth:`zeros` with ``make_formulation(omega, num_tasks, lam=lam, ...)``."""
        return cls.zeros(dim, make_formulation(omega, num_tasks, lam=lam, **options))

    @property
    def lam(self) -> float:
        return self.formulation.lam

    @property
    def num_tasks(self) -> int:
        return self.B.shape[1]

    @property
    def dim(self) -> int:
        return self.B.shape[0]

    def m_diag(self) -> np.ndarray:
        """Diagonal of M = K^-1, one ``m_tt`` per task."""
        return np.diag(self.M).copy()

    def sigma_prime(self, mode: str = "global") -> np.ndarray:
        """Per-task sigma' for the current M (Lemma 9, Remark 5 or spectral)."""
        return self.formulation.sigma_prime(mode)

    def recompute_models(self) -> None:
        """W <- B M."""
        self.W = self.B @ self.M

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
        self.W += delta_B @ self.M[tasks, :]

    def reset_tasks(self, tasks: np.ndarray) -> None:
        """Set b_t = 0 (alpha_t = 0) for the given tasks and update W."""
        tasks = np.asarray(tasks, dtype=np.int64)
        if len(tasks):
            self.add_updates(tasks, -self.B[:, tasks].copy())
            self.B[:, tasks] = 0.0

    def omega_step(self) -> None:
        """Omega-step of the formulation for the current W, then W <- B M."""
        if self.formulation.fixed:
            return
        self.formulation.omega_step(self.W)
        self.M = self.formulation.inverse_matrix()
        self.recompute_models()

    def regulariser(self) -> float:
        """(1/2) tr(W K W^T) of the current consistent pair."""
        return regulariser_value(self.W, self.B)
