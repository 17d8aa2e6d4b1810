"""The task-relationship formulations of MOCHA's appendix B, one class each.

Every formulation writes MOCHA's regulariser as

    R(W) = (1/2) tr(W K W^T) + c(Omega),        K (m x m) symmetric positive definite,

where W (d x m) holds one model per column and c collects the terms without W. For a fixed
Omega the dual map is W(alpha) = B M with M = K^-1 and B = [X_t^T alpha_t / n_t]_t (d x m);
the diagonal ``m_tt = M_tt`` is what task t's local solver needs, and the aggregation
parameter sigma' (appendix D, inequality (28)) is set from M.

Scaling convention: the factor 1/2 above is the package's (``core/objective.py``); the paper
writes its quadratic terms without it, so every lambda that multiplies a term in W is twice
the paper's (e.g. eq. (11)'s lambda1 tr(W Omega W^T) + lambda2 |W|_F^2 is ``lam = 2 lambda1``,
``lam2 = 2 lambda2``; eq. (12)'s and eq. (14)'s lambda is ``lam / 2``). The one exception is
``graphical``'s ``lam2``, the weight of the Omega-only term lambda2 |Omega|_1 of eq. (15):
it is not halved, so ``lam2`` equals the paper's lambda2 while ``lam`` is twice the paper's
lambda (see :class:`GraphicalFormulation`).

Errors name the run-config keys (``lambda``, ``lambda2``, ``s2``, ``eta``, ``clusters``,
``omega-eps``, ``gamma``) that set the keyword arguments ``lam``, ``lam2``, ``s2``, ``eta``,
``k``, ``eps_rel`` and ``gamma``.

Interface (what the server state relies on)
-------------------------------------------
``make_formulation(name, num_tasks, *, lam, lam2=None, s2=None, eta=None, k=None,
eps_rel=1e-3, gamma=1.0)`` builds the formulation registered as ``FORMULATIONS[name]``.
Arguments a formulation does not use are ignored (so a run config can pass all of them);
the ones it uses are validated, and a bad or missing one raises ``ValueError`` naming it.
Each formulation object has

* ``name``, ``num_tasks``, ``lam``, ``gamma`` and ``fixed`` (True when ``omega_step`` never
  changes anything);
* ``inverse_matrix()`` -> M = K^-1, (m, m), symmetric positive definite (a fresh copy);
* ``regulariser_matrix()`` -> K, (m, m);
* ``m_diag()`` -> diag(M), (m,);
* ``omega_step(W)`` -> None: update Omega from the models W (d, m) (no-op for fixed ones).
  After it the caller recomputes W = B @ inverse_matrix();
* ``objective(W)`` -> float: R(W) including the terms without W, for the current Omega;
  ``objective(W) = (1/2) tr(W K W^T) + omega_objective(d)``;
* ``omega_objective(d)`` -> float: c(Omega), the terms of R without W for models of
  dimension d (0 for every formulation except ``graphical``, whose c(Omega) is
  -(lam/2) d log det Omega + lam2 |Omega|_1). The server's primal, whose duality gap it
  reports, has (1/2) tr(W K W^T) as its regulariser (the W-step's objective for fixed
  Omega); adding ``omega_objective(d)`` gives the whole objective of the paper's equation;
* ``step_objective(W)`` -> float: the function of Omega that ``omega_step(W)`` minimises
  exactly (for fixed W). It equals ``objective(W)`` except where the step perturbs W^T W by
  eps I (``probabilistic``; ``graphical`` with ``lam2 = 0`` only; see there). For every
  formulation, ``step_objective(W)`` after ``omega_step(W)`` is <= before (up to the
  graphical lasso's certified tolerance);
* ``sigma_prime(mode)`` -> (m,) for ``mode`` in ``SIGMA_MODES`` (see :func:`sigma_prime`);
* adaptive formulations also have ``omega`` (the paper's Omega for that equation, a copy) and
  ``set_omega(Omega)`` (validated), e.g. to restore a checkpoint.

Formulations
------------
``identity``      K = lam m I (fixed): independent tasks, M = I / (lam m), i.e. Sigma = I / m
                  and M = Sigma / lam as in :mod:`fmtl_flower.core.omega`.
``mean``          eq. (11): K = lam Omega + lam2 I, Omega = (I - 11^T/m)^2 = I - 11^T/m
                  (fixed; lam2 > 0 or K is singular). Closed form
                  M = (I - 11^T/m) / (lam + lam2) + (11^T/m) / lam2.
``probabilistic`` eq. (14): K = lam (Sigma^-1 + I/s2), Sigma = (W^T W + eps I)^(1/2) / trace
                  (:func:`fmtl_flower.core.omega.sigma_probabilistic`), s2 = inf by default,
                  then M = Sigma / lam exactly as the existing core. Starts at Sigma = I / m.
``clustered``     eq. (12): K = lam (eta I + Omega)^-1, M = (eta I + Omega) / lam, Omega in
                  {0 <= Q <= I, tr Q = k}; closed-form step derived in
                  :func:`clustered_eigenvalues`. Starts at Omega = (k/m) I.
``graphical``     eq. (15) with lambda1 = 0: K = lam (Omega + I/s2), s2 finite, penalty
                  lam2 |Omega|_1 on every entry (diagonal included); the step is the
                  graphical lasso on S + alpha I, S = W^T W / d, alpha = 2 lam2 / (lam d),
                  with alpha on the off-diagonal entries. ``lam2`` is the paper's lambda2,
                  ``lam`` twice the paper's lambda. Starts at Omega = m I.

sigma' (appendix D) for a symmetric positive definite M with D = diag(M):

* ``global`` (Lemma 9): gamma * max_t sum_t' |M_tt'| / M_tt, the same for every task;
* ``per-task`` (Remark 5): sigma'_t = gamma * sum_t' |M_tt'| / M_tt;
* ``spectral`` (beyond the paper): gamma * lambda_max(D^-1/2 M D^-1/2), the same for every
  task. With z_t = M_tt^(1/2) u_t, gamma sum_tt' M_tt' <u_t, u_t'> = gamma z^T (C (x) I) z
  <= gamma lambda_max(C) sum_t M_tt |u_t|^2 (C = D^-1/2 M D^-1/2), which is (28); it is the
  smallest uniform sigma' satisfying (28) (equality at the top eigenvector of C), and it is
  never larger than Lemma 9's (Gershgorin on D^-1 M, which is similar to C).

Numerics: symmetric eigendecompositions (``eigh``) of symmetric matrices only, eigenvalues
clipped where round-off could make them negative, Cholesky solves instead of inverses, no
``sqrtm``; every returned M is exactly symmetric.
"""

from __future__ import annotations

import math
import numbers
import warnings
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
import scipy.linalg

from .omega import DEFAULT_OMEGA_EPS, sigma_identity, sigma_probabilistic

__all__ = [
    "FORMULATIONS",
    "SIGMA_MODES",
    "ClusteredFormulation",
    "Formulation",
    "GraphicalFormulation",
    "IdentityFormulation",
    "MeanFormulation",
    "ProbabilisticFormulation",
    "clustered_eigenvalues",
    "graphical_lasso_gap",
    "make_formulation",
    "sigma_prime",
    "solve_graphical_lasso",
]

SIGMA_MODES = ("global", "per-task", "spectral")


# ----------------------------------------------------------------------------- validation


def _real(value: Any, arg: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{arg} must be a real number, got {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{arg} must be a real number, got nan")
    return value


def _positive(value: Any, arg: str, *, allow_inf: bool = False) -> float:
    value = _real(value, arg)
    if not value > 0 or (math.isinf(value) and not allow_inf):
        bound = "> 0 (inf allowed)" if allow_inf else "a finite number > 0"
        raise ValueError(f"{arg} must be {bound}, got {value}")
    return value


def _required(value: Any, arg: str, name: str) -> Any:
    if value is None:
        raise ValueError(f"omega formulation {name!r} requires {arg}")
    return value


def _num_tasks(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"num_tasks must be an integer >= 1, got {value!r}")
    return int(value)


def _gamma(value: Any) -> float:
    value = _real(value, "gamma")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {value}")
    return value


def _symmetric(A: Any, m: int, arg: str) -> np.ndarray:
    A = np.array(A, dtype=np.float64)
    if A.shape != (m, m):
        raise ValueError(f"{arg} must have shape ({m}, {m}), got {A.shape}")
    if not np.all(np.isfinite(A)):
        raise ValueError(f"{arg} has non-finite entries")
    scale = max(1.0, float(np.abs(A).max()))
    if np.abs(A - A.T).max() > 1e-10 * scale:
        raise ValueError(f"{arg} must be symmetric")
    return 0.5 * (A + A.T)


def _sym(A: np.ndarray) -> np.ndarray:
    return 0.5 * (A + A.T)


def _from_eig(evecs: np.ndarray, evals: np.ndarray) -> np.ndarray:
    """V diag(evals) V^T, exactly symmetric."""
    return _sym((evecs * evals) @ evecs.T)


def _logdet_pd(A: np.ndarray) -> float:
    """log det of a symmetric positive definite matrix by Cholesky (raises if not PD)."""
    L = np.linalg.cholesky(A)
    return 2.0 * float(np.log(np.diag(L)).sum())


def _gram_eig(W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (ascending, clipped at 0) and eigenvectors of W^T W."""
    evals, evecs = np.linalg.eigh(W.T @ W)
    return np.clip(evals, 0.0, None), evecs


# ----------------------------------------------------------------------------- sigma'


def sigma_prime(M: np.ndarray, mode: str = "global", gamma: float = 1.0) -> np.ndarray:
    """Aggregation parameter sigma' per task for the inverse regulariser matrix M.

    Parameters
    ----------
    M : ndarray of shape (m, m)
        Symmetric positive definite M = K^-1. The values are invariant to scaling M, so
        Sigma = lam M gives the same result.
    mode : {"global", "per-task", "spectral"}
        ``global``: gamma max_t sum_t' |M_tt'| / M_tt (Lemma 9); ``per-task``:
        gamma sum_t' |M_tt'| / M_tt (Remark 5); ``spectral``:
        gamma lambda_max(D^-1/2 M D^-1/2), D = diag(M) (<= the global value).
    gamma : float
        Aggregation parameter in (0, 1] (appendix D.1).

    Returns
    -------
    ndarray of shape (m,)
        sigma'_t; every value satisfies inequality (28) for its mode.

    Notes
    -----
    Inequality (28) bounds the dual's quadratic term (1/2) tr(B M B^T) across tasks only, so
    these values hold for every loss of :mod:`fmtl_flower.core.losses`; a loss's smoothness
    changes the convergence rate, not sigma'.
    """
    gamma = _gamma(gamma)
    M = np.asarray(M, dtype=np.float64)
    if M.ndim != 2 or M.shape[0] != M.shape[1]:
        raise ValueError(f"M must be a square matrix, got shape {M.shape}")
    diag = np.diag(M).copy()
    if not np.all(np.isfinite(M)) or np.any(diag <= 0):
        raise ValueError("M must be finite with a positive diagonal")
    ratios = np.abs(M).sum(axis=1) / diag
    m = M.shape[0]
    if mode == "global":
        return np.full(m, gamma * ratios.max())
    if mode == "per-task":
        return gamma * ratios
    if mode == "spectral":
        scale = 1.0 / np.sqrt(diag)
        C = _sym(M * np.outer(scale, scale))
        top = scipy.linalg.eigh(C, eigvals_only=True, subset_by_index=[m - 1, m - 1])[0]
        # lambda_max <= max row sum of |D^-1 M| holds exactly; min() only removes round-off.
        return np.full(m, gamma * min(float(top), float(ratios.max())))
    raise ValueError(f"unknown sigma-mode {mode!r}; expected one of {SIGMA_MODES}")


# ----------------------------------------------------------------------------- base class


class Formulation(ABC):
    """R(W) = (1/2) tr(W K W^T) + c(Omega) for m tasks; see the module docstring.

    Attributes
    ----------
    name : str
        Registered name (a key of ``FORMULATIONS``).
    num_tasks : int
        m.
    lam : float
        Regularisation strength (> 0).
    gamma : float
        Aggregation parameter in (0, 1] used by :meth:`sigma_prime`.
    fixed : bool
        True when :meth:`omega_step` never changes Omega.
    """

    name: ClassVar[str]
    fixed: ClassVar[bool]

    def __init__(self, num_tasks: int, *, lam: float, gamma: float = 1.0) -> None:
        self.num_tasks = _num_tasks(num_tasks)
        self.lam = _positive(lam, "lambda")
        self.gamma = _gamma(gamma)

    @classmethod
    @abstractmethod
    def from_options(cls, num_tasks: int, **options: Any) -> Formulation:
        """Build from :func:`make_formulation`'s keyword arguments, ignoring unused ones."""

    @abstractmethod
    def inverse_matrix(self) -> np.ndarray:
        """M = K^-1 (m, m), symmetric positive definite, for the current Omega."""

    @abstractmethod
    def regulariser_matrix(self) -> np.ndarray:
        """K (m, m), symmetric positive definite, for the current Omega."""

    @abstractmethod
    def objective(self, W: np.ndarray) -> float:
        """R(W) for the current Omega, including the terms without W."""

    def omega_step(self, W: np.ndarray) -> None:
        """Update Omega from the models W (d, m). No-op for fixed formulations."""
        self._check_W(W)

    def omega_objective(self, dim: int) -> float:
        """c(Omega): the terms of R without W, for models of dimension ``dim`` (here 0)."""
        return 0.0

    def step_objective(self, W: np.ndarray) -> float:
        """The function of Omega that :meth:`omega_step` minimises (here: :meth:`objective`)."""
        return self.objective(W)

    def m_diag(self) -> np.ndarray:
        """diag(M), one ``m_tt`` per task."""
        return np.diag(self.inverse_matrix()).copy()

    def sigma_prime(self, mode: str = "global") -> np.ndarray:
        """sigma' per task for the current M (see :func:`sigma_prime`)."""
        return sigma_prime(self.inverse_matrix(), mode, self.gamma)

    def _check_W(self, W: Any) -> np.ndarray:
        if not isinstance(W, np.ndarray) or W.ndim != 2 or W.shape[1] != self.num_tasks:
            shape = getattr(W, "shape", None)
            raise ValueError(f"W must be an ndarray of shape (d, {self.num_tasks}), got {shape}")
        if not np.all(np.isfinite(W)):
            raise ValueError("W has non-finite entries")
        return W.astype(np.float64, copy=False)

    def _quad(self, W: np.ndarray, A: np.ndarray) -> float:
        """tr(W A W^T)."""
        return float(np.einsum("ij,jk,ik->", W, A, W))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_tasks={self.num_tasks}, lam={self.lam})"


# ----------------------------------------------------------------------------- fixed ones


class IdentityFormulation(Formulation):
    """K = lam m I (independent tasks), M = I / (lam m). Fixed."""

    name = "identity"
    fixed = True

    @classmethod
    def from_options(cls, num_tasks: int, **options: Any) -> IdentityFormulation:
        return cls(num_tasks, lam=options["lam"], gamma=options.get("gamma", 1.0))

    def inverse_matrix(self) -> np.ndarray:
        # Computed as Sigma / lam with Sigma = I / m, bit-identical to the existing core.
        return sigma_identity(self.num_tasks) / self.lam

    def regulariser_matrix(self) -> np.ndarray:
        return self.lam * self.num_tasks * np.eye(self.num_tasks)

    def objective(self, W: np.ndarray) -> float:
        W = self._check_W(W)
        return 0.5 * self.lam * self.num_tasks * float(np.einsum("ij,ij->", W, W))


class _MeanParameters:
    """What the dense and factored ``mean`` formulations share: ``lam2`` (checked), their
    objective, and a start (``_start``) each makes in its own representation."""

    def __init__(self, num_tasks: int, *, lam: float, lam2: float, gamma: float = 1.0) -> None:
        super().__init__(num_tasks, lam=lam, gamma=gamma)
        self.lam2 = _positive(lam2, "lambda2")
        self._start()

    def objective(self, W: np.ndarray) -> float:
        W = self._check_W(W)
        centred = W - W.mean(axis=1, keepdims=True)
        return 0.5 * (
            self.lam * float(np.einsum("ij,ij->", centred, centred))
            + self.lam2 * float(np.einsum("ij,ij->", W, W))
        )


class MeanFormulation(_MeanParameters, Formulation):
    """Mean-regularised MTL, eq. (11): K = lam Omega + lam2 I, Omega = (I - 11^T/m)^2. Fixed.

    R(W) = (lam/2) sum_t |w_t - w_mean|^2 + (lam2/2) |W|_F^2 (Omega is the projection
    I - 11^T/m, so Omega^2 = Omega). K has eigenvalue lam + lam2 on the complement of 1 and
    lam2 on 1, hence M = (I - 11^T/m) / (lam + lam2) + (11^T/m) / lam2, which needs
    lam2 > 0.
    """

    name = "mean"
    fixed = True

    def _start(self) -> None:
        m = self.num_tasks
        self._P = np.full((m, m), 1.0 / m)  # projection onto span(1)

    @classmethod
    def from_options(cls, num_tasks: int, **options: Any) -> MeanFormulation:
        lam2 = _required(options.get("lam2"), "lambda2 (> 0; K is singular without it)",
                         cls.name)
        return cls(num_tasks, lam=options["lam"], lam2=lam2, gamma=options.get("gamma", 1.0))

    @property
    def omega(self) -> np.ndarray:
        """Omega = (I - 11^T/m)^2 = I - 11^T/m."""
        return np.eye(self.num_tasks) - self._P

    def inverse_matrix(self) -> np.ndarray:
        return _sym(self.omega / (self.lam + self.lam2) + self._P / self.lam2)

    def regulariser_matrix(self) -> np.ndarray:
        return _sym(self.lam * self.omega + self.lam2 * np.eye(self.num_tasks))


# ----------------------------------------------------------------------------- probabilistic


class _ProbabilisticParameters:
    """What the dense and factored ``probabilistic`` formulations share: ``s2`` and
    ``eps_rel`` (checked), and a start (Sigma = I / m, ``_start``) each makes in its own
    representation."""

    def __init__(
        self,
        num_tasks: int,
        *,
        lam: float,
        s2: float = math.inf,
        eps_rel: float = DEFAULT_OMEGA_EPS,
        gamma: float = 1.0,
    ) -> None:
        super().__init__(num_tasks, lam=lam, gamma=gamma)
        self.s2 = _positive(s2, "s2", allow_inf=True)
        self.eps_rel = _positive(eps_rel, "omega-eps")
        self._start()


class ProbabilisticFormulation(_ProbabilisticParameters, Formulation):
    """MTL with a matrix-normal prior, eq. (14): K = lam (Sigma^-1 + I/s2).

    R(W) = (lam/2) (tr(W Sigma^-1 W^T) + |W|_F^2 / s2), Sigma in {Sigma > 0, tr Sigma = 1}
    (eq. (14)'s Omega is Sigma). The Omega-step is
    :func:`fmtl_flower.core.omega.sigma_probabilistic`: Sigma = (W^T W + eps I)^(1/2) / trace
    with eps = eps_rel lambda_max(W^T W), the exact minimiser over unit-trace Sigma of
    ``step_objective(W) = (lam/2) (tr(Sigma^-1 (W^T W + eps I)) + |W|_F^2 / s2)``
    (the perturbed trace-norm problem; ``objective`` has eps = 0). With s2 = inf (default)
    M = Sigma / lam, exactly the existing core; otherwise M = (1/lam) V diag(s2 sigma_i /
    (s2 + sigma_i)) V^T over Sigma's eigenpairs. Starts at Sigma = I / m.
    """

    name = "probabilistic"
    fixed = False

    def _start(self) -> None:
        self._set_sigma(sigma_identity(self.num_tasks))

    @classmethod
    def from_options(cls, num_tasks: int, **options: Any) -> ProbabilisticFormulation:
        s2 = options.get("s2")
        return cls(
            num_tasks,
            lam=options["lam"],
            s2=math.inf if s2 is None else s2,
            eps_rel=options.get("eps_rel", DEFAULT_OMEGA_EPS),
            gamma=options.get("gamma", 1.0),
        )

    def _set_sigma(self, sigma: np.ndarray) -> None:
        evals, evecs = np.linalg.eigh(sigma)
        if evals[0] <= 0:
            raise ValueError("Sigma must be positive definite")
        self._sigma = sigma
        self._evals, self._evecs = evals, evecs

    @property
    def omega(self) -> np.ndarray:
        """Sigma (eq. (14)'s Omega): symmetric positive definite with unit trace."""
        return self._sigma.copy()

    sigma = omega

    def set_omega(self, sigma: np.ndarray) -> None:
        """Set Sigma (symmetric positive definite, trace 1 within 1e-8)."""
        sigma = _symmetric(sigma, self.num_tasks, "Sigma")
        if abs(np.trace(sigma) - 1.0) > 1e-8:
            raise ValueError(f"Sigma must have unit trace, got {np.trace(sigma)}")
        self._set_sigma(sigma)

    def omega_step(self, W: np.ndarray) -> None:
        W = self._check_W(W)
        self._set_sigma(sigma_probabilistic(W, self.eps_rel))

    def inverse_matrix(self) -> np.ndarray:
        if math.isinf(self.s2):
            return self._sigma / self.lam
        s = self._evals
        return _from_eig(self._evecs, self.s2 * s / (self.s2 + s) / self.lam)

    def regulariser_matrix(self) -> np.ndarray:
        return _from_eig(self._evecs, self.lam * (1.0 / self._evals + 1.0 / self.s2))

    def objective(self, W: np.ndarray) -> float:
        W = self._check_W(W)
        proj = W @ self._evecs
        value = float((np.einsum("ij,ij->j", proj, proj) / self._evals).sum())
        return 0.5 * self.lam * (value + float(np.einsum("ij,ij->", W, W)) / self.s2)

    def step_objective(self, W: np.ndarray) -> float:
        W = self._check_W(W)
        evals, _ = _gram_eig(W)
        eps = self.eps_rel * float(evals[-1])
        return self.objective(W) + 0.5 * self.lam * eps * float((1.0 / self._evals).sum())


# ----------------------------------------------------------------------------- clustered


def clustered_eigenvalues(mu: np.ndarray, eta: float, k: float) -> np.ndarray:
    """Eigenvalues q of the clustered Omega-step for Gram eigenvalues mu.

    Solves  min_q sum_i mu_i / (eta + q_i)  s.t.  0 <= q_i <= 1, sum_i q_i = k.

    Derivation. The step of eq. (12) is min_Q tr(A (eta I + Q)^-1), A = W^T W = V diag(mu)
    V^T, over Q in {0 <= Q <= I, tr Q = k} (Zhou, Chen and Ye 2011; Jacob, Bach and Vert
    2008). For Q with eigenvalues q, C = (eta I + Q)^-1 has eigenvalues 1/(eta + q_i), and
    the lower von Neumann trace inequality gives tr(A C) >= sum_i mu_i / (eta + q_i) with mu
    sorted decreasingly and q decreasingly (largest mu against smallest 1/(eta + q)), with
    equality for Q = V diag(q) V^T. The constraints only involve the eigenvalues of Q, so
    the optimum shares A's eigenvectors, and what remains is the convex separable problem
    above. Its KKT conditions, with multiplier nu > 0 for sum q = k and the box handled per
    coordinate, give q_i = clip(sqrt(mu_i / nu) - eta, 0, 1), i.e. with tau = nu^(-1/2)

        q_i(tau) = clip(tau sqrt(mu_i) - eta, 0, 1),     sum_i q_i(tau) = k,

    (larger mu gets larger q, as the inequality requires). The left side is continuous,
    nondecreasing and piecewise linear in tau with breakpoints eta / sqrt(mu_i) and
    (eta + 1) / sqrt(mu_i); tau is found exactly by evaluating it at the sorted breakpoints
    and interpolating linearly on the bracketing piece (a one-dimensional search on the KKT
    multiplier, no iteration tolerance). If only r <= k of the mu_i are positive the sum
    cannot exceed r: then q_i = 1 where mu_i > 0 and the remaining k - r is spread evenly,
    (k - r) / (m - r) <= 1, over the null directions, where it does not change the objective
    (W = 0 gives q = k / m).

    Parameters
    ----------
    mu : ndarray of shape (m,)
        Eigenvalues of W^T W (>= 0; values <= m * machine-eps * max(mu) count as 0).
    eta : float
        > 0.
    k : float
        In (0, m].

    Returns
    -------
    ndarray of shape (m,)
        q in [0, 1]^m with sum k, in the order of ``mu``.
    """
    mu = np.clip(np.asarray(mu, dtype=np.float64), 0.0, None)
    m = mu.size
    eta = _positive(eta, "eta")
    k = _positive(k, "k")
    if k > m:
        raise ValueError(f"k must be in (0, num_tasks={m}], got {k}")
    top = float(mu.max()) if m else 0.0
    positive = mu > m * np.finfo(np.float64).eps * top if top > 0 else np.zeros(m, bool)
    r = int(positive.sum())
    q = np.zeros(m)
    if r <= k:
        q[positive] = 1.0
        if r < m:
            q[~positive] = (k - r) / (m - r)
        return q
    s = np.sqrt(mu[positive])
    breaks = np.sort(np.concatenate([eta / s, (eta + 1.0) / s]))
    totals = np.clip(np.outer(breaks, s) - eta, 0.0, 1.0).sum(axis=1)  # nondecreasing
    j = int(np.searchsorted(totals, k, side="left"))  # totals[j-1] < k <= totals[j]
    j = min(max(j, 1), breaks.size - 1)
    lo, hi = breaks[j - 1], breaks[j]
    span = totals[j] - totals[j - 1]
    tau = hi if span <= 0 else lo + (k - totals[j - 1]) * (hi - lo) / span
    q[positive] = np.clip(tau * s - eta, 0.0, 1.0)
    return q


class _ClusteredParameters:
    """What the dense and factored ``clustered`` formulations share: ``eta`` and ``k``
    (checked, ``k <= num_tasks``), and a start (Omega = (k/m) I, ``_start``) each makes in its
    own representation."""

    def __init__(
        self, num_tasks: int, *, lam: float, eta: float, k: float, gamma: float = 1.0
    ) -> None:
        super().__init__(num_tasks, lam=lam, gamma=gamma)
        self.eta = _positive(eta, "eta")
        self.k = _positive(k, "clusters")
        if self.k > self.num_tasks:
            raise ValueError(f"clusters must be in (0, num_tasks={self.num_tasks}], got {k}")
        self._start()


class ClusteredFormulation(_ClusteredParameters, Formulation):
    """Clustered MTL (convex relaxation), eq. (12): K = lam (eta I + Omega)^-1.

    R(W) = (lam/2) tr(W (eta I + Omega)^-1 W^T), Omega in {0 <= Q <= I, tr Q = k}, k the
    number of clusters, so M = (eta I + Omega) / lam (no inverse needed: W(alpha) =
    B (eta I + Omega) / lam). The Omega-step is the exact minimiser, Omega = V diag(q) V^T
    with V the eigenvectors of W^T W and q from :func:`clustered_eigenvalues`. Starts at
    Omega = (k/m) I.
    """

    name = "clustered"
    fixed = False

    def _start(self) -> None:
        m = self.num_tasks
        self._evecs = np.eye(m)
        self._q = np.full(m, self.k / m)

    @classmethod
    def from_options(cls, num_tasks: int, **options: Any) -> ClusteredFormulation:
        eta = _required(options.get("eta"), "eta (> 0)", cls.name)
        k = _required(options.get("k"), "clusters (the number k of clusters, in (0, num_tasks])",
                      cls.name)
        return cls(num_tasks, lam=options["lam"], eta=eta, k=k, gamma=options.get("gamma", 1.0))

    @property
    def omega(self) -> np.ndarray:
        """Omega = V diag(q) V^T in {0 <= Q <= I, tr Q = k}."""
        return _from_eig(self._evecs, self._q)

    @property
    def omega_eigenvalues(self) -> np.ndarray:
        """Eigenvalues q of Omega (in [0, 1], summing to k)."""
        return self._q.copy()

    def set_omega(self, omega: np.ndarray) -> None:
        """Set Omega (symmetric, eigenvalues in [0, 1] and trace k, within 1e-8)."""
        omega = _symmetric(omega, self.num_tasks, "Omega")
        q, V = np.linalg.eigh(omega)
        if q[0] < -1e-8 or q[-1] > 1 + 1e-8 or abs(q.sum() - self.k) > 1e-8 * self.num_tasks:
            raise ValueError("Omega must satisfy 0 <= Omega <= I and tr(Omega) = k")
        self._evecs, self._q = V, np.clip(q, 0.0, 1.0)

    def omega_step(self, W: np.ndarray) -> None:
        W = self._check_W(W)
        mu, V = _gram_eig(W)
        self._q = clustered_eigenvalues(mu, self.eta, self.k)
        self._evecs = V

    def inverse_matrix(self) -> np.ndarray:
        return _from_eig(self._evecs, (self.eta + self._q) / self.lam)

    def regulariser_matrix(self) -> np.ndarray:
        return _from_eig(self._evecs, self.lam / (self.eta + self._q))

    def objective(self, W: np.ndarray) -> float:
        W = self._check_W(W)
        proj = W @ self._evecs
        return (
            0.5 * self.lam * float((np.einsum("ij,ij->j", proj, proj) / (self.eta + self._q)).sum())
        )


# ----------------------------------------------------------------------------- graphical


def graphical_lasso_gap(S: np.ndarray, alpha: float, omega: np.ndarray) -> float:
    """Duality gap of ``omega`` for  min tr(S Omega) - log det Omega + alpha |Omega|_off.

    |.|_off sums |Omega_ij| over i != j (both triangles). The dual is
    max { log det(S + G) + m : |G_ij| <= alpha (i != j), G_ii = 0, S + G > 0 }; the dual
    point is G = off-diagonal clip(Omega^-1 - S, -alpha, alpha), exact at the optimum. The
    gap bounds the primal sub-optimality of ``omega``; ``inf`` if a matrix is not positive
    definite.
    """
    m = S.shape[0]
    try:
        c = scipy.linalg.cho_factor(omega, lower=True)
    except np.linalg.LinAlgError:
        return math.inf
    logdet = 2.0 * float(np.log(np.diag(c[0])).sum())
    off = np.abs(omega).sum() - np.abs(np.diag(omega)).sum()
    primal = float(np.sum(S * omega)) - logdet + alpha * off
    G = np.clip(_sym(scipy.linalg.cho_solve(c, np.eye(m))) - S, -alpha, alpha)
    np.fill_diagonal(G, 0.0)
    try:
        dual = _logdet_pd(S + G) + m
    except np.linalg.LinAlgError:
        return math.inf
    return primal - dual


def _glasso_admm(S: np.ndarray, alpha: float, tol: float, max_iter: int) -> np.ndarray:
    """ADMM for the graphical lasso (Boyd et al. 2011, sec. 6.5), stopped on the dual gap.

    The Omega-update is the closed-form prox of tr(S X) - log det X through a symmetric
    eigendecomposition, so every iterate X is positive definite.
    """
    m = S.shape[0]
    Z = np.diag(1.0 / np.diag(S))
    U = np.zeros((m, m))
    rho = 1.0
    offdiag = ~np.eye(m, dtype=bool)
    best, best_gap = Z, graphical_lasso_gap(S, alpha, Z)
    for it in range(1, max_iter + 1):
        evals, evecs = np.linalg.eigh(_sym(rho * (Z - U) - S))
        X = _from_eig(evecs, (evals + np.sqrt(evals * evals + 4.0 * rho)) / (2.0 * rho))
        Z_old = Z
        Z = X + U
        Z[offdiag] = np.sign(Z[offdiag]) * np.maximum(np.abs(Z[offdiag]) - alpha / rho, 0.0)
        U = U + X - Z
        if it % 10 == 0:
            # Z (soft-thresholded) carries the sparsity: prefer it once certified.
            gap_z = graphical_lasso_gap(S, alpha, Z)
            if gap_z <= tol:
                return Z
            gap_x = graphical_lasso_gap(S, alpha, X)
            if gap_x < best_gap:
                best, best_gap = X, gap_x
            r = np.linalg.norm(X - Z)
            s = rho * np.linalg.norm(Z - Z_old)
            if r > 10.0 * s:
                rho, U = 2.0 * rho, U / 2.0
            elif s > 10.0 * r:
                rho, U = rho / 2.0, 2.0 * U
    return best


def _sklearn_glasso(S: np.ndarray, alpha: float, tol: float) -> np.ndarray | None:
    """``sklearn.covariance.graphical_lasso``'s precision matrix, or None when it fails."""
    from sklearn.covariance import graphical_lasso
    from sklearn.exceptions import ConvergenceWarning

    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", ConvergenceWarning)
            warnings.simplefilter("ignore", RuntimeWarning)
            _, prec = graphical_lasso(S, alpha, mode="cd", tol=tol, enet_tol=1e-12, max_iter=200)
    except (FloatingPointError, ValueError, np.linalg.LinAlgError):
        return None
    return _sym(prec) if np.all(np.isfinite(prec)) else None


def solve_graphical_lasso(
    S: np.ndarray, alpha: float, *, tol: float = 1e-8, max_iter: int = 20000
) -> tuple[np.ndarray, str, float]:
    """Solve  min_{Omega > 0} tr(S Omega) - log det Omega + alpha sum_{i != j} |Omega_ij|.

    ``sklearn.covariance.graphical_lasso`` (which leaves the diagonal unpenalised) is tried
    first on S scaled to unit mean diagonal (its tolerances are absolute); its answer is
    accepted when the certified duality gap (:func:`graphical_lasso_gap`) is <= ``tol * m``.
    scikit-learn's block coordinate descent raises "Non SPD result" on the ill-conditioned S
    of m > d with small alpha (measured: d = 9, m = 29, alpha <= 1e-2 relative); then, or
    when its gap is too large, ADMM (:func:`_glasso_admm`) solves to the same certified gap.
    alpha = 0 is solved exactly, Omega = S^-1 by ``eigh``.

    Returns
    -------
    omega : ndarray of shape (m, m)
        Symmetric positive definite minimiser.
    solver : str
        ``"exact"``, ``"sklearn"`` or ``"admm"``.
    gap : float
        Certified duality gap of ``omega`` (0 for ``"exact"``).
    """
    from threadpoolctl import threadpool_limits  # a dependency of scikit-learn

    m = S.shape[0]
    c = float(np.trace(S)) / m
    Sn, an = _sym(S / c), alpha / c
    if alpha == 0:
        evals, evecs = np.linalg.eigh(Sn)
        return _from_eig(evecs, 1.0 / evals) / c, "exact", 0.0
    target = tol * m
    # m x m LAPACK calls are far too small for threads: with a multi-threaded BLAS each eigh
    # is several times slower (measured 2 ms vs 0.17 ms at m = 29 on 2 cores).
    with threadpool_limits(limits=1, user_api="blas"):
        omega, solver, gap = _sklearn_glasso(Sn, an, target), "sklearn", math.inf
        if omega is not None:
            gap = graphical_lasso_gap(Sn, an, omega)
        if omega is None or not gap <= target:
            candidate = _glasso_admm(Sn, an, target, max_iter)
            candidate_gap = graphical_lasso_gap(Sn, an, candidate)
            if omega is None or candidate_gap < gap:
                omega, solver, gap = candidate, "admm", candidate_gap
    if not math.isfinite(gap):
        raise FloatingPointError("graphical lasso: no positive definite solution found")
    return omega / c, solver, gap


class GraphicalFormulation(Formulation):
    """MTL with a sparse task precision matrix, eq. (15) with lambda1 = 0.

    R(W) = (lam/2) (tr(W Omega W^T) - d log det Omega + |W|_F^2 / s2) + lam2 |Omega|_1,

    |Omega|_1 = sum_{i,j} |Omega_ij| over every entry, the diagonal included, as in eq. (15).
    K = lam (Omega + I/s2) (s2 finite: without the |W|_F^2 term a singular Omega would leave
    K singular), M = K^-1 by a Cholesky solve. lambda1 = 0 (no l1 term on W, which would make
    W(alpha) non-linear).

    Scaling against the paper. Eq. (15) reads lambda (|W|^2 / sigma^2 + tr(W Omega W^T)
    - d log|Omega|) + lambda2 |Omega|_1. The package's 1/2 in front of the terms in W makes
    ``lam`` = 2 lambda (twice the paper's), while ``lam2`` multiplies |Omega|_1 directly:
    ``lam2`` = lambda2 (equal to the paper's), and ``s2`` = sigma^2. (The run-config keys
    ``lambda`` and ``lambda2`` are ``lam`` and ``lam2``.)

    Omega-step, lam2 > 0. For fixed W (d rows) the terms with Omega are

        (lam d / 2) (tr(S Omega) - log det Omega + alpha |Omega|_1),
        S = W^T W / d,  alpha = 2 lam2 / (lam d).

    Every positive definite Omega has a positive diagonal, so the diagonal part of the
    penalty is alpha sum_i Omega_ii = tr(alpha I Omega): the step is exactly the
    off-diagonal graphical lasso (scikit-learn's convention, which leaves the diagonal free)
    on S + alpha I with penalty alpha,

        min_{Omega > 0} tr((S + alpha I) Omega) - log det Omega + alpha sum_{i != j} |Omega_ij|,

    solved by :func:`solve_graphical_lasso` (scikit-learn, ADMM when scikit-learn fails) to a
    certified duality gap (``last_solver``, ``last_gap``; the gap is the same for both
    forms). For alpha far below the scale of S (measured: alpha / mean(diag S) ~ 1e-4, m > d)
    S + alpha I is ill-conditioned, scikit-learn fails and ADMM can stop at its iteration
    limit above the target gap; ``last_gap`` then says how far. At the optimum
    diag(Omega^-1) = diag(S) + alpha (Friedman, Hastie and Tibshirani 2008, who penalise the
    diagonal the same way). S + alpha I is positive definite, so the
    step is well posed for every W, also W = 0 (Omega = I / alpha) and m > d, and needs no
    perturbation: ``step_objective(W) == objective(W)``, and the Omega-step never increases
    the objective for fixed W (up to (lam d / 2) times the certified gap). The penalty on the
    diagonal is what bounds the objective below: with it free (the package before issue 20)
    Omega = c I at W = 0 sends -log det Omega, and the objective, to minus infinity.

    Omega-step, lam2 = 0. Omega = S^-1, which exists only if W^T W is nonsingular (m <= d and
    no w_t = 0); so, as in the probabilistic step, S = (W^T W + eps I) / d with
    eps = eps_rel lambda_max(W^T W) (``omega-eps``), and ``step_objective(W)`` =
    ``objective(W)`` + (lam/2) eps tr Omega. For W = 0 Omega is kept.

    Starts at Omega = m I.
    """

    name = "graphical"
    fixed = False

    def __init__(
        self,
        num_tasks: int,
        *,
        lam: float,
        lam2: float,
        s2: float,
        eps_rel: float = DEFAULT_OMEGA_EPS,
        gamma: float = 1.0,
        tol: float = 1e-8,
    ) -> None:
        super().__init__(num_tasks, lam=lam, gamma=gamma)
        self.lam2 = _real(lam2, "lambda2")
        if not (0.0 <= self.lam2 < math.inf):
            raise ValueError(f"lambda2 must be a finite number >= 0, got {lam2}")
        self.s2 = _positive(s2, "s2")
        self.eps_rel = _positive(eps_rel, "omega-eps")
        self.tol = _positive(tol, "tol")
        self.last_solver: str | None = None
        self.last_gap: float | None = None
        self._set_omega(self.num_tasks * np.eye(self.num_tasks))

    @classmethod
    def from_options(cls, num_tasks: int, **options: Any) -> GraphicalFormulation:
        lam2 = _required(options.get("lam2"), "lambda2 (>= 0, the penalty on Omega)", cls.name)
        s2 = _required(options.get("s2"), "a finite s2 (> 0)", cls.name)
        return cls(
            num_tasks,
            lam=options["lam"],
            lam2=lam2,
            s2=s2,
            eps_rel=options.get("eps_rel", DEFAULT_OMEGA_EPS),
            gamma=options.get("gamma", 1.0),
        )

    def _set_omega(self, omega: np.ndarray) -> None:
        K = self.lam * (omega + np.eye(self.num_tasks) / self.s2)
        self._omega = omega
        self._K = _sym(K)
        self._chol = scipy.linalg.cho_factor(self._K, lower=True)

    @property
    def omega(self) -> np.ndarray:
        """The task precision matrix Omega (symmetric positive definite)."""
        return self._omega.copy()

    def set_omega(self, omega: np.ndarray) -> None:
        """Set Omega (symmetric positive definite)."""
        omega = _symmetric(omega, self.num_tasks, "Omega")
        if np.linalg.eigvalsh(omega)[0] <= 0:
            raise ValueError("Omega must be positive definite")
        self._set_omega(omega)

    def _eps(self, W: np.ndarray) -> float:
        """The perturbation eps of W^T W (0 when lam2 > 0)."""
        if self.lam2 > 0.0:
            return 0.0
        return self.eps_rel * float(_gram_eig(W)[0][-1])

    def omega_step(self, W: np.ndarray) -> None:
        W = self._check_W(W)
        d, m = W.shape
        gram = _sym(W.T @ W)
        if self.lam2 > 0.0:
            alpha = 2.0 * self.lam2 / (self.lam * d)
            shifted = gram / d + alpha * np.eye(m)  # the diagonal penalty, see the docstring
            omega, self.last_solver, self.last_gap = solve_graphical_lasso(
                shifted, alpha, tol=self.tol
            )
        else:
            eps = self._eps(W)
            if eps <= 0.0:  # W = 0: no minimiser, Omega is kept
                return
            omega, self.last_solver, self.last_gap = solve_graphical_lasso(
                (gram + eps * np.eye(m)) / d, 0.0
            )
        self._set_omega(omega)

    def inverse_matrix(self) -> np.ndarray:
        return _sym(scipy.linalg.cho_solve(self._chol, np.eye(self.num_tasks)))

    def regulariser_matrix(self) -> np.ndarray:
        return self._K.copy()

    def omega_objective(self, dim: int) -> float:
        """c(Omega) = -(lam/2) d log det Omega + lam2 |Omega|_1 (every entry), d = ``dim``."""
        logdet = _logdet_pd(self._omega)
        return -0.5 * self.lam * dim * logdet + self.lam2 * float(np.abs(self._omega).sum())

    def objective(self, W: np.ndarray) -> float:
        W = self._check_W(W)
        quad = self._quad(W, self._omega) + float(np.einsum("ij,ij->", W, W)) / self.s2
        return 0.5 * self.lam * quad + self.omega_objective(W.shape[0])

    def step_objective(self, W: np.ndarray) -> float:
        W = self._check_W(W)
        eps = self._eps(W)
        return self.objective(W) + 0.5 * self.lam * eps * float(np.trace(self._omega))


# ----------------------------------------------------------------------------- registry

FORMULATIONS: dict[str, type[Formulation]] = {
    cls.name: cls
    for cls in (
        IdentityFormulation,
        MeanFormulation,
        ProbabilisticFormulation,
        ClusteredFormulation,
        GraphicalFormulation,
    )
}


def options_check_size(num_tasks: int, k: float | None = None) -> int:
    """A task count small enough to build a dense formulation cheaply, large enough that
    :func:`make_formulation` validates the same options as for ``num_tasks`` tasks (the
    ``clustered`` k must not exceed it). Used to check options before the server path (dense
    or factored) is known."""
    m = int(num_tasks)
    if k is None or isinstance(k, bool) or not isinstance(k, int | float) or not math.isfinite(k):
        return min(m, 64)
    return min(m, max(64, math.ceil(k)))


def make_formulation(
    name: str,
    num_tasks: int,
    *,
    lam: float,
    lam2: float | None = None,
    s2: float | None = None,
    eta: float | None = None,
    k: float | None = None,
    eps_rel: float = DEFAULT_OMEGA_EPS,
    gamma: float = 1.0,
) -> Formulation:
    """Build the formulation ``name`` for ``num_tasks`` tasks.

    Parameters
    ----------
    name : str
        A key of ``FORMULATIONS``: identity, mean, probabilistic, clustered, graphical.
    num_tasks : int
        m >= 1.
    lam : float
        lambda > 0 (every formulation).
    lam2 : float, optional
        ``mean``: the |W|_F^2 weight, required > 0 (run-config key ``lambda2``);
        ``graphical``: the weight of lam2 |Omega|_1 (every entry), required >= 0 (0: Omega
        is the perturbed inverse of W^T W / d), equal to eq. (15)'s lambda2.
    s2 : float, optional
        sigma^2 of eqs. (14)/(15): ``probabilistic`` (default inf, no |W|_F^2 term);
        ``graphical`` (required, finite).
    eta, k : float, optional
        ``clustered`` only, both required: eta > 0, k in (0, num_tasks].
    eps_rel : float
        Relative eigenvalue floor of W^T W for ``probabilistic`` and ``graphical`` (> 0).
    gamma : float
        Aggregation parameter in (0, 1] for sigma'.

    Arguments the formulation does not use are ignored.

    Raises
    ------
    ValueError
        Unknown ``name``, or a missing or invalid argument (named in the message).
    """
    cls = FORMULATIONS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"unknown omega formulation name {name!r}; expected one of {tuple(FORMULATIONS)}"
        )
    _num_tasks(num_tasks)
    _positive(lam, "lambda")
    _positive(eps_rel, "omega-eps")
    _gamma(gamma)
    return cls.from_options(
        num_tasks, lam=lam, lam2=lam2, s2=s2, eta=eta, k=k, eps_rel=eps_rel, gamma=gamma
    )
