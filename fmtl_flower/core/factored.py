"""Factored task matrices for many tasks (m >> d): never form an m x m matrix.

Every formulation of :mod:`.formulations` except ``graphical`` has an inverse regulariser
matrix M = K^-1 (and K, and Omega or Sigma) of the form

    A = V diag(s) V^T + c I,          V (m x r) with orthonormal columns, r <= min(d, m),

because its Omega-step is a spectral function of W^T W, whose rank is at most d:

* ``identity``: r = 0, M = I / (lam m);
* ``mean``: r = 1, V = 1 / sqrt(m), M = I / (lam + lam2) + (1/lam2 - 1/(lam + lam2)) 11^T / m;
* ``probabilistic``: Sigma = (W^T W + eps I)^(1/2) / trace. On the null space of W^T W every
  eigenvalue of Sigma equals sqrt(eps) / trace, which is c; the r nonzero eigenvalues mu_k of
  W^T W give s_k = (sqrt(mu_k + eps) - sqrt(eps)) / trace (:func:`sigma_probabilistic_factored`);
* ``clustered``: Omega = V diag(q) V^T + q_0 (I - V V^T) with q from
  :func:`fmtl_flower.core.formulations.clustered_eigenvalues`.

:class:`FactoredMatrix` keeps (V, s, c) and does in O(m r) or O(m d r) what the dense path does
with m x m matrices: spectral functions (the inverse, Woodbury: (V diag(s) V^T + c I)^-1 =
V diag(1/(s + c) - 1/c) V^T + I / c), W(alpha) = B M, the diagonal m_tt, tr(W A W^T), and
sigma' (:func:`sigma_prime_factored`). The only O(m^2) step is the absolute row sums that
Lemma 9 and Remark 5 need (O(m^2 r / 2) flops in tiles, O(m r) memory).

The thin eigendecomposition (:func:`gram_eigen`) uses the d x d matrix W W^T: its eigenvalues
mu_k are the nonzero ones of W^T W, and V = W^T U diag(mu)^(-1/2), re-orthonormalised.

Measured with ``benchmarks/server_step.py`` (probabilistic, d = 100, 1 BLAS thread, process
CPU time on a shared 2-core machine): Omega-step + spectral sigma' + W(alpha) take 0.08 s at
m = 10 000 and 0.6-0.7 s at m = 100 000 (peak RSS 375 MB, W and B included); the dense path
needs ~15 min and 6 GB at m = 10 000. Lemma 9 / Remark 5 sigma' take 0.5 s at m = 10 000 and
42 s at m = 100 000 (O(m^2 d)); they are computed once per Omega-step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.linalg
import scipy.linalg.blas
import scipy.sparse.linalg

from .formulations import (
    SIGMA_MODES,
    ClusteredFormulation,
    Formulation,
    IdentityFormulation,
    MeanFormulation,
    ProbabilisticFormulation,
    _ClusteredParameters,
    _gamma,
    _MeanParameters,
    _positive,
    _ProbabilisticParameters,
    clustered_eigenvalues,
)
from .omega import DEFAULT_OMEGA_EPS

__all__ = [
    "DENSE_MATERIALISE_MAX_TASKS",
    "FACTORED_FORMULATIONS",
    "FactoredClustered",
    "FactoredFormulation",
    "FactoredIdentity",
    "FactoredMatrix",
    "FactoredMean",
    "FactoredProbabilistic",
    "gram_eigen",
    "make_factored_formulation",
    "sigma_prime_factored",
    "sigma_probabilistic_factored",
]

#: Largest m for which the factored classes agree to build a dense m x m matrix
#: (``dense()``, ``inverse_matrix()``, ...): 20 000 tasks are 3.2 GB per matrix.
DENSE_MATERIALISE_MAX_TASKS = 20_000

_EPS = float(np.finfo(np.float64).eps)
_TILE = 1024  # rows/columns of one tile of the absolute row sums: 8 MB of float64


def _gemm_into(C: np.ndarray, A: np.ndarray, B: np.ndarray) -> None:
    """C += A @ B in place (BLAS dgemm with beta = 1, no temporary of C's size).

    C must be Fortran-contiguous float64 (e.g. the transpose of a C-ordered array); A and B
    are passed transposed when that avoids a copy.
    """

    def operand(X: np.ndarray) -> tuple[np.ndarray, int]:
        if X.flags.f_contiguous:
            return X, 0
        if X.flags.c_contiguous:
            return X.T, 1
        return np.asfortranarray(X), 0

    a, trans_a = operand(A)
    b, trans_b = operand(B)
    res = scipy.linalg.blas.dgemm(
        1.0, a, b, beta=1.0, c=C, trans_a=trans_a, trans_b=trans_b, overwrite_c=True
    )
    if not np.shares_memory(res, C):  # pragma: no cover - only for a non-contiguous C
        C[...] = res


def _dense_guard(m: int, what: str) -> None:
    if m > DENSE_MATERIALISE_MAX_TASKS:
        raise ValueError(
            f"{what} would form an {m} x {m} matrix ({8 * m * m / 2**30:.1f} GiB); the factored "
            f"path forms dense matrices only up to {DENSE_MATERIALISE_MAX_TASKS} tasks; use the "
            "factor (V, s, c) instead"
        )


# ----------------------------------------------------------------------------- the matrix


@dataclass(frozen=True, eq=False)
class FactoredMatrix:
    """Symmetric A = V diag(s) V^T + c I (m x m) kept as its factors.

    Parameters
    ----------
    V : ndarray of shape (m, r)
        Orthonormal columns (V^T V = I_r to rounding; not checked, see :meth:`check`).
        r = 0 is allowed (A = c I).
    s : ndarray of shape (r,)
        Weights of the columns; A's eigenvalues are s + c and c (multiplicity m - r).
    c : float
        Multiple of the identity.

    Notes
    -----
    Because V is orthonormal, a function f of A is V diag(f(s + c) - f(c)) V^T + f(c) I
    (:meth:`apply`), e.g. the inverse. When r = m, c is only a bookkeeping constant.
    """

    V: np.ndarray
    s: np.ndarray
    c: float

    def __post_init__(self) -> None:
        V = np.asarray(self.V, dtype=np.float64)
        s = np.asarray(self.s, dtype=np.float64).reshape(-1)
        if V.ndim != 2 or V.shape[1] != s.shape[0] or V.shape[1] > V.shape[0]:
            raise ValueError(f"V must be (m, r) with r <= m and s (r,), got {V.shape}, {s.shape}")
        c = float(self.c)
        if not (np.all(np.isfinite(s)) and math.isfinite(c)):
            raise ValueError("s and c must be finite")
        object.__setattr__(self, "V", V)
        object.__setattr__(self, "s", s)
        object.__setattr__(self, "c", c)

    # -------------------------------------------------------------- construction
    @classmethod
    def scaled_identity(cls, m: int, c: float) -> FactoredMatrix:
        """c I_m (rank 0)."""
        return cls(np.zeros((m, 0)), np.zeros(0), c)

    @classmethod
    def from_dense(cls, A: np.ndarray) -> FactoredMatrix:
        """Full-rank factor of a dense symmetric A (eigh; r = m, c = 0). For tests."""
        evals, evecs = np.linalg.eigh(0.5 * (A + A.T))
        return cls(evecs, evals, 0.0)

    # -------------------------------------------------------------- basic properties
    @property
    def num_tasks(self) -> int:
        """m."""
        return self.V.shape[0]

    @property
    def rank(self) -> int:
        """r, the number of columns of V."""
        return self.V.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        """(m, m), the shape of the dense A (so ``np.shape`` works as on an array)."""
        return self.num_tasks, self.num_tasks

    def eigenvalues(self) -> tuple[np.ndarray, float, int]:
        """(s + c, c, m - r): the r eigenvalues on span(V), and c with its multiplicity."""
        return self.s + self.c, self.c, self.num_tasks - self.rank

    def min_eigenvalue(self) -> float:
        top, c, null = self.eigenvalues()
        return float(min(top.min(initial=math.inf), c if null else math.inf))

    def max_eigenvalue(self) -> float:
        top, c, null = self.eigenvalues()
        return float(max(top.max(initial=-math.inf), c if null else -math.inf))

    def check(self, atol: float = 1e-10) -> None:
        """Raise ValueError unless V^T V = I within ``atol`` (O(m r^2))."""
        gram = self.V.T @ self.V
        err = float(np.abs(gram - np.eye(self.rank)).max(initial=0.0))
        if err > atol:
            raise ValueError(f"V is not orthonormal: max |V^T V - I| = {err:.3g}")

    def dense(self) -> np.ndarray:
        """A as an m x m array (exactly symmetric). O(m^2 r); for small m and tests."""
        _dense_guard(self.num_tasks, "FactoredMatrix.dense()")
        A = (self.V * self.s) @ self.V.T
        A = 0.5 * (A + A.T)
        A[np.diag_indices_from(A)] += self.c
        return A

    def diag(self) -> np.ndarray:
        """diag(A), (m,): c + sum_k s_k V_tk^2. O(m r)."""
        return np.einsum("ij,ij,j->i", self.V, self.V, self.s) + self.c

    def trace(self) -> float:
        """tr(A) = sum(s) + m c."""
        return float(self.s.sum() + self.num_tasks * self.c)

    # -------------------------------------------------------------- algebra
    def apply(self, f: Callable[[np.ndarray], np.ndarray]) -> FactoredMatrix:
        """f(A) for a scalar function f (vectorised): V diag(f(s + c) - f(c)) V^T + f(c) I."""
        values = np.asarray(f(self.s + self.c), dtype=np.float64)
        if self.rank == self.num_tasks:  # V is square: no null space, c is bookkeeping
            return FactoredMatrix(self.V, values, 0.0)
        fc = float(np.asarray(f(np.array([self.c])))[0])
        return FactoredMatrix(self.V, values - fc, fc)

    def scale(self, alpha: float) -> FactoredMatrix:
        """alpha A."""
        return FactoredMatrix(self.V, alpha * self.s, alpha * self.c)

    def inverse(self) -> FactoredMatrix:
        """A^-1 (Woodbury): V diag(1/(s + c) - 1/c) V^T + I / c. A must be nonsingular."""
        top, c, null = self.eigenvalues()
        if np.any(top == 0) or (null and c == 0):
            raise ValueError("FactoredMatrix.inverse(): the matrix is singular")
        return self.apply(lambda x: 1.0 / x)

    def right_multiply(self, B: np.ndarray) -> np.ndarray:
        """B A for B of shape (d, m): c B + ((B V) diag(s)) V^T. O(m d r), one d x m array."""
        B = np.asarray(B, dtype=np.float64)
        if B.ndim != 2 or B.shape[1] != self.num_tasks:
            raise ValueError(f"B must be (d, {self.num_tasks}), got {B.shape}")
        out = np.multiply(B, self.c)  # a fresh C-ordered (d, m) array
        if self.rank:
            P = (B @ self.V) * self.s
            _gemm_into(out.T, self.V, P.T)  # out^T += V P^T
        return out

    def add_rows_product(self, out: np.ndarray, delta_B: np.ndarray, tasks: np.ndarray) -> None:
        """out += delta_B A[tasks, :] in place, without forming A's rows. O(m d r).

        Parameters
        ----------
        out : ndarray of shape (d, m)
            Updated in place (no d x m temporary when it is C-contiguous float64).
        delta_B : ndarray of shape (d, k)
        tasks : ndarray of shape (k,), int
            Distinct row indices.
        """
        tasks = np.asarray(tasks, dtype=np.int64)
        delta_B = np.asarray(delta_B, dtype=np.float64)
        if self.rank:
            P = (delta_B @ self.V[tasks]) * self.s
            if out.dtype == np.float64 and out.flags.c_contiguous:
                _gemm_into(out.T, self.V, P.T)
            else:
                out += P @ self.V.T
        out[:, tasks] += self.c * delta_B

    def rows_product(self, delta_B: np.ndarray, tasks: np.ndarray) -> np.ndarray:
        """delta_B A[tasks, :] (d x m) without forming A's rows. O(m d r).

        Parameters
        ----------
        delta_B : ndarray of shape (d, k)
        tasks : ndarray of shape (k,), int
            Distinct row indices.
        """
        out = np.zeros((np.shape(delta_B)[0], self.num_tasks))
        self.add_rows_product(out, delta_B, tasks)
        return out

    def quad_trace(self, W: np.ndarray) -> float:
        """tr(W A W^T) for W of shape (d, m). O(m d r).

        Computed as sum_k (s_k + c) |W v_k|^2 + c (|W|_F^2 - |W V|_F^2): the eigenvalue c
        weighs the part of W outside span(V).
        """
        W = np.asarray(W, dtype=np.float64)
        total = float(np.einsum("ij,ij->", W, W))
        if not self.rank:
            return self.c * total
        proj = W @ self.V
        norms = np.einsum("ij,ij->j", proj, proj)
        return float(((self.s + self.c) * norms).sum() + self.c * (total - norms.sum()))

    # -------------------------------------------------------------- sigma' pieces
    def abs_row_sums(self, tile: int = _TILE) -> np.ndarray:
        """sum_t' |A_tt'| for every row t, (m,), never holding more than a tile x tile block.

        Rank 0 and 1 have closed forms (O(m)). Otherwise the off-diagonal part P = V diag(s)
        V^T is formed in tile x tile blocks of its upper block triangle; each block adds its
        row sums to its rows and (off the block diagonal) its column sums to its columns, so
        every entry is computed once: m^2 r / 2 multiply-adds, O(m r + tile^2) memory.
        """
        m, r = self.V.shape
        c = self.c
        if r == 0:
            return np.full(m, abs(c))
        if r == 1:
            v = self.V[:, 0]
            absv = np.abs(v)
            p_diag = self.s[0] * v * v
            return abs(self.s[0]) * absv * absv.sum() - np.abs(p_diag) + np.abs(p_diag + c)
        tile = max(1, int(tile))
        Vs = self.V * self.s
        out = np.zeros(m)
        buf = np.empty(tile * tile)
        for a in range(0, m, tile):
            b = min(m, a + tile)
            left = Vs[a:b]
            for c0 in range(a, m, tile):
                c1 = min(m, c0 + tile)
                T = buf[: (b - a) * (c1 - c0)].reshape(b - a, c1 - c0)
                np.matmul(left, self.V[c0:c1].T, out=T)
                if c0 == a:
                    p_diag = np.diagonal(T).copy()
                    out[a:b] += np.abs(p_diag + c) - np.abs(p_diag)
                np.abs(T, out=T)
                out[a:b] += T.sum(axis=1)
                if c0 != a:
                    out[c0:c1] += T.sum(axis=0)
        return out

    def scaled_top_eigenvalue(self, *, method: str = "auto") -> float:
        """lambda_max(D^-1/2 A D^-1/2), D = diag(A) (> 0): the spectral sigma' / gamma.

        C = D^-1/2 A D^-1/2 = diag(a) + Y Y^T with a = c / D and Y = D^-1/2 V diag(s)^(1/2)
        (s >= 0). ``method``:

        * ``"secular"``: the largest root of the secular equation
          lambda_max(Y^T (lambda I - diag(a))^-1 Y) = 1 (:func:`_top_secular`): a safeguarded
          Newton iteration on an r x r matrix, O(m r^2) per step, exact to rounding whatever
          the eigenvalue gaps (a handful of steps; needs s >= 0, true for every formulation);
        * ``"lanczos"``: ARPACK on C applied in O(m r) per step, from a fixed start vector
          (deterministic); any s. Slow when C's top eigenvalues are close (measured 2-4 s
          at m = 100 000, r = 100, against ~0.2 s for ``"secular"``). Without convergence it
          returns the Weyl upper bound max(a) + lambda_max(Y_+^T Y_+), which still satisfies
          inequality (28);
        * ``"dense"``: eigh of C (m <= ``DENSE_MATERIALISE_MAX_TASKS``);
        * ``"auto"``: dense for m <= 64, else secular (lanczos if some s < 0).
        """
        m, r = self.V.shape
        D = self.diag()
        if not (np.all(np.isfinite(D)) and np.all(D > 0)):
            raise ValueError("the matrix must have a finite, positive diagonal")
        if r == 0:
            return 1.0  # A = c I
        if method == "auto":
            method = "dense" if m <= 64 else ("secular" if np.all(self.s >= 0) else "lanczos")
        if method == "dense":
            _dense_guard(m, "scaled_top_eigenvalue(method='dense')")
            scale = 1.0 / np.sqrt(D)
            C = self.dense() * np.outer(scale, scale)
            C = 0.5 * (C + C.T)
            return float(scipy.linalg.eigh(C, eigvals_only=True, subset_by_index=[m - 1, m - 1])[0])
        if method == "secular":
            if np.any(self.s < 0):
                raise ValueError("method='secular' needs s >= 0; use 'lanczos'")
            return _top_secular(self.V, self.s, self.c, D)
        a = self.c / D
        Z = self.V / np.sqrt(D)[:, None]
        if method != "lanczos":
            raise ValueError(
                f"method must be 'auto', 'secular', 'lanczos' or 'dense', got {method!r}"
            )
        s = self.s

        def matvec(x: np.ndarray) -> np.ndarray:
            x = x.reshape(-1)
            return a * x + Z @ (s * (Z.T @ x))

        op = scipy.sparse.linalg.LinearOperator((m, m), matvec=matvec, dtype=np.float64)
        v0 = np.random.default_rng(0x5EED).standard_normal(m)  # fixed: deterministic result
        try:
            top = scipy.sparse.linalg.eigsh(
                op,
                k=1,
                which="LA",
                v0=v0,
                tol=0.0,
                ncv=min(m, 40),
                maxiter=max(1000, 10 * r),
                return_eigenvectors=False,
            )
            return max(1.0, float(top[0]))
        except scipy.sparse.linalg.ArpackNoConvergence:
            Yp = Z * np.sqrt(np.clip(s, 0.0, None))
            return float(a.max() + np.linalg.eigvalsh(Yp.T @ Yp)[-1])


def _top_secular(
    V: np.ndarray, s: np.ndarray, c: float, D: np.ndarray, max_iter: int = 100
) -> float:
    """lambda_max(D^-1/2 (V diag(s) V^T + c I) D^-1/2) for s >= 0, D = the diagonal (> 0).

    The matrix is diag(a) + Y Y^T with a = c / D, Y = D^-1/2 V diag(s)^(1/2). For lambda >
    max(a), lambda is an eigenvalue iff 1 is an eigenvalue of the r x r matrix
    H(lambda) = Y^T (lambda I - diag(a))^-1 Y = diag(s)^(1/2) V^T diag(1 / (lambda D - c)) V
    diag(s)^(1/2) (Y^T x = y: x = (lambda - diag(a))^-1 Y y), and mu(lambda) =
    lambda_max(H(lambda)) decreases from +inf to 0 on (max(a), inf), so the largest
    eigenvalue is the root of g(lambda) = 1 - 1/mu(lambda) (or max(a) when none exists).
    Newton's method on g, the usual form for secular equations: g is linear when a is
    constant (one step) and nearly linear when a varies little. It starts at the Weyl bound
    max(a) + lambda_max(Y^T Y); the bracket [lo, hi] (lo = 1, the unit diagonal) turns any
    step that would leave it into a bisection. It stops when a step is below 1e-10 relative,
    after which Newton's quadratic convergence leaves only rounding. Each step costs
    O(m r^2) (an r x r Gram matrix and its eigh) and one m x r buffer.
    """
    a = c / D
    a_max = float(a.max())
    root_s = np.sqrt(s)
    buf = np.empty_like(V, order="F")

    def gram(weights: np.ndarray) -> np.ndarray:  # diag(s)^1/2 V^T diag(weights) V diag(s)^1/2
        np.multiply(V, np.sqrt(weights)[:, None], out=buf)
        G = buf.T @ buf
        return G * np.outer(root_s, root_s)

    hi = a_max + float(np.linalg.eigvalsh(gram(1.0 / D))[-1])
    hi += 64 * _EPS * abs(hi)
    lo = max(a_max, float(np.max(a + (D - c) / D)))  # = 1 up to rounding
    if not hi > lo:
        return hi
    lam = hi
    for _ in range(max_iter):
        if lam <= a_max:  # only when lo == a_max (a row of V vanishes): stay in the domain
            lam = 0.5 * (a_max + hi)
        omega = 1.0 / (lam * D - c)
        mu, vecs = np.linalg.eigh(gram(omega))
        top = float(mu[-1])
        if top == 1.0:
            return lam
        if top > 1.0:
            lo = max(lo, lam)
        else:
            hi = min(hi, lam)
        v = V @ (root_s * vecs[:, -1])  # u = D^-1/2 v, w = 1 / (lam - a) = D omega
        slope = float(np.sum(v * v * D * omega * omega))  # -d mu / d lambda > 0
        new = lam + top * (top - 1.0) / slope if slope > 0 else 0.5 * (lo + hi)
        if not lo <= new <= hi:
            new = 0.5 * (lo + hi)
        if abs(new - lam) <= 1e-10 * abs(new) or hi - lo <= 4 * _EPS * abs(hi):
            return new
        lam = new
    return hi  # not reached in practice; hi is an upper bound, safe for inequality (28)


def sigma_prime_factored(
    A: FactoredMatrix, mode: str = "global", gamma: float = 1.0, *, tile: int = _TILE
) -> np.ndarray:
    """sigma' per task for M = A in factored form; the same values as
    :func:`fmtl_flower.core.formulations.sigma_prime` on ``A.dense()`` (to rounding).

    ``spectral`` costs a few O(m r^2) steps (:meth:`FactoredMatrix.scaled_top_eigenvalue`);
    ``global`` (Lemma 9) and ``per-task``
    (Remark 5) need the absolute row sums, O(m^2 r / 2) flops in tiles
    (:meth:`FactoredMatrix.abs_row_sums`): compute them once per Omega-step, not per round.
    (The dense function also caps ``spectral`` at the Lemma 9 value, which only removes
    round-off; that cap is not applied here, it would cost the row sums.)

    Returns
    -------
    ndarray of shape (m,)
    """
    gamma = _gamma(gamma)
    if mode not in SIGMA_MODES:
        raise ValueError(f"unknown sigma-mode {mode!r}; expected one of {SIGMA_MODES}")
    m = A.num_tasks
    if mode == "spectral":
        return np.full(m, gamma * A.scaled_top_eigenvalue())
    diag = A.diag()
    if not np.all(np.isfinite(diag)) or np.any(diag <= 0):
        raise ValueError("M must be finite with a positive diagonal")
    ratios = A.abs_row_sums(tile=tile) / diag
    if mode == "global":
        return np.full(m, gamma * ratios.max())
    return gamma * ratios


# ----------------------------------------------------------------------------- thin eigen


def gram_eigen(W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues of W^T W and orthonormal eigenvectors of its numerically nonzero ones.

    m <= d: ``eigh(W^T W)`` (m x m), every eigenvector kept (r = m), as the dense path.
    m > d: ``eigh(W W^T)`` (d x d) gives the d largest eigenvalues mu and U; the eigenvectors
    of W^T W are W^T U diag(mu)^(-1/2). Only directions with mu > m eps mu_max are kept (the
    rest are round-off of zero, the threshold of
    :func:`fmtl_flower.core.formulations.clustered_eigenvalues`); the kept columns, in
    decreasing order of mu, are re-orthonormalised by a Cholesky QR (the better-determined
    directions first), so V^T V = I to rounding. O(m d^2) flops, O(m d) memory.

    Parameters
    ----------
    W : ndarray of shape (d, m)

    Returns
    -------
    mu : ndarray of shape (min(d, m),)
        Eigenvalues of W^T W, decreasing, clipped at 0 (the m - d others are 0).
    V : ndarray of shape (m, r)
        Orthonormal eigenvectors of mu[:r].
    """
    W = np.asarray(W, dtype=np.float64)
    d, m = W.shape
    if m <= d:
        evals, evecs = np.linalg.eigh(W.T @ W)
        return np.clip(evals[::-1], 0.0, None), evecs[:, ::-1]
    evals, U = np.linalg.eigh(W @ W.T)
    mu = np.clip(evals[::-1], 0.0, None)
    U = U[:, ::-1]
    top = float(mu[0]) if d else 0.0
    if not math.isfinite(top):
        raise FloatingPointError("W W^T has non-finite eigenvalues")
    r = int(np.count_nonzero(mu > m * _EPS * top)) if top > 0 else 0
    if r == 0:
        return mu, np.zeros((m, 0))
    Y = ((U[:, :r].T / np.sqrt(mu[:r])[:, None]) @ W).T  # (m, r), Fortran order, ~orthonormal
    try:
        L = np.linalg.cholesky(Y.T @ Y)
    except np.linalg.LinAlgError:  # not seen in practice; Householder QR is always safe
        Q, R = np.linalg.qr(Y)
        return mu, Q * np.sign(np.diag(R))
    V = scipy.linalg.blas.dtrsm(1.0, L, Y, side=1, lower=1, trans_a=1, overwrite_b=1)  # Y L^-T
    return mu, V


def sigma_probabilistic_factored(
    W: np.ndarray, eps_rel: float = DEFAULT_OMEGA_EPS
) -> FactoredMatrix:
    """Factored :func:`fmtl_flower.core.omega.sigma_probabilistic`.

    Sigma = (W^T W + eps I)^(1/2) / trace, eps = eps_rel mu_max, W = 0 -> I / m. With the
    nonzero eigenpairs (mu_k, v_k) of W^T W (:func:`gram_eigen`) and S = sum_k
    sqrt(mu_k + eps) + (m - r) sqrt(eps) (the trace of the root),

        Sigma = V diag((sqrt(mu + eps) - sqrt(eps)) / S) V^T + (sqrt(eps) / S) I.

    Directions that :func:`gram_eigen` drops (mu <= m eps_mach mu_max) count as mu = 0: this
    changes their eigenvalue of Sigma by a relative ~mu / (2 eps) <= m eps_mach / (2 eps_rel),
    the size of the round-off the dense path leaves in its null eigenvalues.

    Returns
    -------
    FactoredMatrix
        Sigma, unit trace, c > 0, s >= 0.
    """
    if eps_rel <= 0:
        raise ValueError(f"eps_rel must be > 0, got {eps_rel}")
    W = np.asarray(W, dtype=np.float64)
    m = W.shape[1]
    mu, V = gram_eigen(W)
    top = float(mu[0]) if mu.size else 0.0
    if not math.isfinite(top):
        raise FloatingPointError("W^T W has non-finite eigenvalues")
    if top <= 0.0:
        return FactoredMatrix.scaled_identity(m, 1.0 / m)
    r = V.shape[1]
    eps = eps_rel * top
    roots = np.sqrt(mu[:r] + eps)
    root0 = math.sqrt(eps)
    total = float(roots.sum() + (m - r) * root0)
    return FactoredMatrix(V, (roots - root0) / total, root0 / total)


# ----------------------------------------------------------------------------- formulations


def same_options_as(dense: type[Formulation]) -> classmethod:
    """``dense.from_options`` as a classmethod of a factored formulation whose constructor
    takes the same arguments (one reading of :func:`make_formulation`'s options)."""
    return classmethod(dense.from_options.__func__)


class FactoredFormulation(Formulation):
    """A formulation whose M = K^-1 is kept as a :class:`FactoredMatrix`.

    The interface of :class:`fmtl_flower.core.formulations.Formulation` (same names, same
    values to rounding), plus ``inverse_factor()`` (M) and ``regulariser_factor()`` (K).
    ``inverse_matrix()`` / ``regulariser_matrix()`` build the dense m x m matrices (small m
    and tests only); ``m_diag()``, ``sigma_prime()``, ``objective()`` never do.
    """

    def inverse_factor(self) -> FactoredMatrix:
        """M = K^-1 in factored form."""
        raise NotImplementedError

    def regulariser_factor(self) -> FactoredMatrix:
        """K in factored form."""
        raise NotImplementedError

    def inverse_matrix(self) -> np.ndarray:
        return self.inverse_factor().dense()

    def regulariser_matrix(self) -> np.ndarray:
        return self.regulariser_factor().dense()

    def m_diag(self) -> np.ndarray:
        return self.inverse_factor().diag()

    def sigma_prime(self, mode: str = "global") -> np.ndarray:
        return sigma_prime_factored(self.inverse_factor(), mode, self.gamma)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Arrays that restore Omega with :meth:`load_state_arrays` (empty for fixed ones)."""
        return {}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Inverse of :meth:`state_arrays`."""
        if arrays:
            raise ValueError(f"{self.name}: unexpected formulation arrays {sorted(arrays)}")


def _factor_arrays(prefix: str, A: FactoredMatrix) -> dict[str, np.ndarray]:
    return {f"{prefix}.V": A.V, f"{prefix}.s": A.s, f"{prefix}.c": np.array(A.c)}


def _factor_from_arrays(prefix: str, arrays: dict[str, np.ndarray], m: int) -> FactoredMatrix:
    keys = {f"{prefix}.V", f"{prefix}.s", f"{prefix}.c"}
    if set(arrays) != keys:
        raise ValueError(f"expected arrays {sorted(keys)}, got {sorted(arrays)}")
    V = np.array(arrays[f"{prefix}.V"], dtype=np.float64)
    if V.ndim != 2 or V.shape[0] != m:
        raise ValueError(f"{prefix}.V must be ({m}, r), got {V.shape}")
    c = np.asarray(arrays[f"{prefix}.c"], dtype=np.float64)
    if c.shape != ():
        raise ValueError(f"{prefix}.c must be a scalar, got shape {c.shape}")
    if not np.all(np.isfinite(V)):
        raise ValueError(f"{prefix}.V has non-finite entries")
    return FactoredMatrix(V, np.array(arrays[f"{prefix}.s"], dtype=np.float64), float(c))


class FactoredIdentity(FactoredFormulation):
    """Factored ``identity``: K = lam m I, M = I / (lam m) (r = 0). Fixed."""

    name = "identity"
    fixed = True

    # the same constructor arguments as the dense class: read its options the same way
    from_options = same_options_as(IdentityFormulation)

    def inverse_factor(self) -> FactoredMatrix:
        # (1/m)/lam, the same rounding as the dense sigma_identity(m) / lam
        return FactoredMatrix.scaled_identity(self.num_tasks, (1.0 / self.num_tasks) / self.lam)

    def regulariser_factor(self) -> FactoredMatrix:
        return FactoredMatrix.scaled_identity(self.num_tasks, self.lam * self.num_tasks)

    def objective(self, W: np.ndarray) -> float:
        W = self._check_W(W)
        return 0.5 * self.lam * self.num_tasks * float(np.einsum("ij,ij->", W, W))


class FactoredMean(_MeanParameters, FactoredFormulation):
    """Factored ``mean`` (eq. 11): K = (lam + lam2) I - lam 11^T/m (r = 1). Fixed.

    M = I / (lam + lam2) + (1/lam2 - 1/(lam + lam2)) 11^T / m.
    """

    name = "mean"
    fixed = True

    def _start(self) -> None:
        self._u = np.full((self.num_tasks, 1), 1.0 / math.sqrt(self.num_tasks))

    # the same constructor arguments as the dense class: read its options the same way
    from_options = same_options_as(MeanFormulation)

    @property
    def omega_factor(self) -> FactoredMatrix:
        """Omega = I - 11^T/m as a :class:`FactoredMatrix`."""
        return FactoredMatrix(self._u, np.array([-1.0]), 1.0)

    @property
    def omega(self) -> np.ndarray:
        """Omega = I - 11^T/m as a dense array (m <= ``DENSE_MATERIALISE_MAX_TASKS``)."""
        return self.omega_factor.dense()

    def inverse_factor(self) -> FactoredMatrix:
        c = 1.0 / (self.lam + self.lam2)
        return FactoredMatrix(self._u, np.array([1.0 / self.lam2 - c]), c)

    def regulariser_factor(self) -> FactoredMatrix:
        return FactoredMatrix(self._u, np.array([-self.lam]), self.lam + self.lam2)


class FactoredProbabilistic(_ProbabilisticParameters, FactoredFormulation):
    """Factored ``probabilistic`` (eq. 14): K = lam (Sigma^-1 + I/s2), Sigma factored.

    Same Omega-step, objective and step objective as
    :class:`fmtl_flower.core.formulations.ProbabilisticFormulation`, with Sigma from
    :func:`sigma_probabilistic_factored`. M = Sigma / lam (s2 = inf) or
    f(Sigma) with f(x) = s2 x / ((s2 + x) lam). Starts at Sigma = I / m.
    """

    name = "probabilistic"
    fixed = False

    def _start(self) -> None:
        self._sigma = FactoredMatrix.scaled_identity(self.num_tasks, 1.0 / self.num_tasks)

    # the same constructor arguments as the dense class: read its options the same way
    from_options = same_options_as(ProbabilisticFormulation)

    @property
    def sigma_factor(self) -> FactoredMatrix:
        """Sigma as a :class:`FactoredMatrix` (immutable, so not copied)."""
        return self._sigma

    @property
    def omega(self) -> np.ndarray:
        """Sigma as a dense array (m <= ``DENSE_MATERIALISE_MAX_TASKS``)."""
        return self._sigma.dense()

    sigma = omega

    def set_omega(self, sigma: FactoredMatrix) -> None:
        """Set Sigma from its factor (positive definite, trace 1 within 1e-8)."""
        if not isinstance(sigma, FactoredMatrix) or sigma.num_tasks != self.num_tasks:
            raise ValueError(f"Sigma must be a FactoredMatrix with {self.num_tasks} rows")
        if sigma.min_eigenvalue() <= 0:
            raise ValueError("Sigma must be positive definite")
        if abs(sigma.trace() - 1.0) > 1e-8:
            raise ValueError(f"Sigma must have unit trace, got {sigma.trace()}")
        self._sigma = sigma

    def omega_step(self, W: np.ndarray) -> None:
        W = self._check_W(W)
        self._sigma = sigma_probabilistic_factored(W, self.eps_rel)

    def inverse_factor(self) -> FactoredMatrix:
        if math.isinf(self.s2):
            return self._sigma.scale(1.0 / self.lam)
        s2, lam = self.s2, self.lam
        return self._sigma.apply(lambda x: s2 * x / (s2 + x) / lam)

    def regulariser_factor(self) -> FactoredMatrix:
        s2, lam = self.s2, self.lam
        return self._sigma.apply(lambda x: lam * (1.0 / x + 1.0 / s2))

    def objective(self, W: np.ndarray) -> float:
        W = self._check_W(W)
        value = self._sigma.inverse().quad_trace(W)
        return 0.5 * self.lam * (value + float(np.einsum("ij,ij->", W, W)) / self.s2)

    def step_objective(self, W: np.ndarray) -> float:
        W = self._check_W(W)
        eps = self.eps_rel * _gram_top(W)
        return self.objective(W) + 0.5 * self.lam * eps * self._sigma.inverse().trace()

    def state_arrays(self) -> dict[str, np.ndarray]:
        return _factor_arrays("sigma", self._sigma)

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.set_omega(_factor_from_arrays("sigma", arrays, self.num_tasks))


def _gram_top(W: np.ndarray) -> float:
    """lambda_max(W^T W) (>= 0), from the smaller of W^T W and W W^T."""
    d, m = W.shape
    gram = W.T @ W if m <= d else W @ W.T
    return max(0.0, float(np.linalg.eigvalsh(gram)[-1])) if gram.size else 0.0


class FactoredClustered(_ClusteredParameters, FactoredFormulation):
    """Factored ``clustered`` (eq. 12): M = (eta I + Omega) / lam, Omega factored.

    Omega = V diag(q - q0) V^T + q0 I: q from
    :func:`fmtl_flower.core.formulations.clustered_eigenvalues` on the m eigenvalues of
    W^T W (the d of :func:`gram_eigen`, then m - d zeros), q0 the common value of the zero
    ones; only directions with q != q0 are kept. Starts at Omega = (k/m) I.
    """

    name = "clustered"
    fixed = False

    def _start(self) -> None:
        self._omega = FactoredMatrix.scaled_identity(self.num_tasks, self.k / self.num_tasks)

    # the same constructor arguments as the dense class: read its options the same way
    from_options = same_options_as(ClusteredFormulation)

    @property
    def omega_factor(self) -> FactoredMatrix:
        """Omega as a :class:`FactoredMatrix`."""
        return self._omega

    @property
    def omega(self) -> np.ndarray:
        """Omega as a dense array (m <= ``DENSE_MATERIALISE_MAX_TASKS``)."""
        return self._omega.dense()

    @property
    def omega_eigenvalues(self) -> np.ndarray:
        """The m eigenvalues q of Omega, increasing (as the dense class for distinct mu)."""
        top, c, null = self._omega.eigenvalues()
        return np.sort(np.concatenate([top, np.full(null, c)]))

    def set_omega(self, omega: FactoredMatrix) -> None:
        """Set Omega from its factor (eigenvalues in [0, 1], trace k, within 1e-8)."""
        if not isinstance(omega, FactoredMatrix) or omega.num_tasks != self.num_tasks:
            raise ValueError(f"Omega must be a FactoredMatrix with {self.num_tasks} rows")
        if (
            omega.min_eigenvalue() < -1e-8
            or omega.max_eigenvalue() > 1 + 1e-8
            or abs(omega.trace() - self.k) > 1e-8 * self.num_tasks
        ):
            raise ValueError("Omega must satisfy 0 <= Omega <= I and tr(Omega) = k")
        self._omega = omega

    def omega_step(self, W: np.ndarray) -> None:
        W = self._check_W(W)
        m = self.num_tasks
        mu, V = gram_eigen(W)
        r = V.shape[1]
        full = np.concatenate([mu, np.zeros(m - mu.size)])
        q = clustered_eigenvalues(full, self.eta, self.k)
        if r == m:  # m <= d: every eigenvector is in V
            self._omega = FactoredMatrix(V, q, 0.0)
            return
        q0 = float(q[-1])  # an eigenvalue 0 of W^T W (directions r.. are all such)
        keep = np.flatnonzero(q[:r] != q0)
        self._omega = FactoredMatrix(V[:, keep], q[keep] - q0, q0)

    def inverse_factor(self) -> FactoredMatrix:
        eta, lam = self.eta, self.lam
        return self._omega.apply(lambda x: (eta + x) / lam)

    def regulariser_factor(self) -> FactoredMatrix:
        eta, lam = self.eta, self.lam
        return self._omega.apply(lambda x: lam / (eta + x))

    def objective(self, W: np.ndarray) -> float:
        W = self._check_W(W)
        return 0.5 * self.regulariser_factor().quad_trace(W)

    def state_arrays(self) -> dict[str, np.ndarray]:
        return _factor_arrays("omega", self._omega)

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.set_omega(_factor_from_arrays("omega", arrays, self.num_tasks))


FACTORED_FORMULATIONS: dict[str, type[FactoredFormulation]] = {
    cls.name: cls
    for cls in (FactoredIdentity, FactoredMean, FactoredProbabilistic, FactoredClustered)
}


def make_factored_formulation(
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
) -> FactoredFormulation:
    """:func:`fmtl_flower.core.formulations.make_formulation` for the factored classes.

    Same arguments and validation; ``graphical`` has no factored form (its Omega-step, the
    graphical lasso, gives a dense Omega) and raises ValueError.
    """
    cls = FACTORED_FORMULATIONS.get(name) if isinstance(name, str) else None
    if cls is None:
        if name == "graphical":
            raise ValueError(
                "omega formulation 'graphical' has no factored form (its Omega is a "
                "dense sparse-precision matrix); use the dense path"
            )
        raise ValueError(
            f"unknown omega formulation name {name!r}; expected one of "
            f"{tuple(FACTORED_FORMULATIONS)} (factored)"
        )
    if isinstance(num_tasks, bool) or not isinstance(num_tasks, numbers.Integral) or num_tasks < 1:
        raise ValueError(f"num_tasks must be an integer >= 1, got {num_tasks!r}")
    _positive(lam, "lambda")
    _positive(eps_rel, "omega-eps")
    _gamma(gamma)
    return cls.from_options(
        int(num_tasks), lam=lam, lam2=lam2, s2=s2, eta=eta, k=k, eps_rel=eps_rel, gamma=gamma
    )
