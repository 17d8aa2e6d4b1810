"""OFMTL's numerics (Li et al. 2019): a newcomer task's subproblem, the Sigma extension, Omega.

Setting. m tasks have trained models W_old = [w_1 .. w_m] (d x m) that stay **frozen**; a new
task (column index m, 0-based, i.e. task m+1) with data X (n x d) and labels y in {-1, +1}
joins. The package's objective (``core/objective.py``, ``core/formulations.py``) is

    P(W) = sum_t (1/n_t) sum_i max(0, 1 - y_ti x_ti^T w_t) + (1/2) tr(W K W^T),

with K the formulation's regulariser matrix; for the ``probabilistic`` formulation (OFMTL's,
eq. (14) of MOCHA with s2 = inf) K = lam Omega, Omega = Sigma^-1, tr Sigma = 1, so the
regulariser is the reference code's (lam/2) tr(W Omega W^T). Over the (m+1)-column
W = [W_old, w] the part of P that depends on w is

    (1/2) tr(W K W^T) = (1/2) K_mm |w|^2 + w^T sum_{t<m} K_tm w_t + (terms without w),

so, with K = lam Omega, the newcomer's problem -- MOCHA's W-subproblem in column m with the
other columns fixed -- is exactly

    P_new(w) = (1/n) sum_i max(0, 1 - y_i x_i^T w) + (lam/2) omega |w|^2 + lam c^T w,
    omega = Omega[m, m],   c = sum_{t<m} Omega[t, m] w_t = W_old Omega[:m, m]          (*)

(P minus P_new does not depend on w). For a general formulation pass omega = K_mm / lam and
c = W_old K[:m, m] / lam; e.g. ``probabilistic`` with finite s2 (K = lam (Omega + I/s2))
gives omega = Omega_mm + 1/s2 and the same c.

Losses. The hinge above is the default; every function below takes ``loss`` (a name or
:class:`~fmtl_flower.core.losses.Loss`, the run's ``mocha.loss``) and then reads
l(y_i x_i^T w) for the hinge term and D(a) = -l*(-a) (a = y_i alpha_i in the loss's dual
domain) for y_i alpha_i below. The subproblem is well-defined for **every** registered loss:
P_new is (lam omega)-strongly convex whatever the convex l, so its minimiser is unique, and
the derivation below only uses the conjugate of r, never a bound on alpha. The built-in
losses keep their compiled SDCA branch; a registered loss of Python code runs the kernel's
numpy implementation (:mod:`fmtl_flower.core.losses`). Written for the hinge:

Dual. With dual variables alpha (one per sample, 0 <= y_i alpha_i <= 1 as in MOCHA),
b = X^T alpha / n and r(w) = (lam/2) omega |w|^2 + lam c^T w, whose conjugate is
r*(b) = |b - lam c|^2 / (2 lam omega),

    D_new(alpha) = (1/n) sum_i y_i alpha_i - |b - lam c|^2 / (2 lam omega),
    w(alpha)     = grad r*(b) = (b - lam c) / (lam omega)                              (**)

(the paper's eq. (3) and the reference code's closed-form refresh). At w = w(alpha) the two
quadratic terms coincide: D_new = (1/n) sum y alpha - (lam/2) omega |w|^2, and the duality
gap P_new(w(alpha)) - D_new(alpha) = (1/n) sum hinge_i - (1/n) sum y_i alpha_i + w^T b >= 0
(for another loss: (1/n) sum l_i - (1/n) sum D(y_i alpha_i) + w^T b, >= 0 by Fenchel-Young).

SDCA. One exact coordinate step on sample i (a = y_i alpha_i, w = w(alpha)) is

    a_new = clip(a + lam omega n (1 - y_i x_i^T w) / |x_i|^2, 0, 1),
    w    += (alpha_new - alpha_old) x_i / (lam omega n),

which is MOCHA's local step (``core/sdca.py``) with m_tt sigma' = 1 / (lam omega): the
compiled ``_sdca_kernel`` is reused as is, with the loss's code (another loss takes its
coordinate step, :func:`fmtl_flower.core.losses.coordinate_step`, with q = |x_i|^2 /
(lam omega n)). No sigma' is involved, since only one task moves:
these are exact SDCA steps of the single-task problem. Because (**) is affine in b, the
kernel's running model is w(alpha) throughout; :func:`newcomer_model` recomputes it exactly.

Zero-norm rows (x_i = 0) do not move w; the exact coordinate maximiser of D_new there is
a = 1 (the dual gains (1 - a)/n; argmax D for another loss). The kernel moves such rows
to it (the kernels' zero-row rule), so :func:`newcomer_sdca` sets y_i alpha_i = 1 for those
it visits; the duality gap therefore still goes to 0.

Extension. A new task extends Sigma (m x m, symmetric PSD, trace 1) to
blockdiag(m/(m+1) Sigma, 1/(m+1)): trace 1 is kept and the newcomer starts uncorrelated, so
c = 0 and w(0) = 0 at the start, as in the reference code. (The paper's eq. (6) writes the
same scaling on Omega, which would not keep tr(Omega^-1) = 1; the authors' code scales Sigma,
as here.) Omega = Sigma^-1 by a symmetric eigendecomposition, never a general inverse. The
server's message to the newcomer is (omega, c): d + 1 floats.

Omega-step. Over all m+1 columns, the same closed form as MOCHA
(:func:`fmtl_flower.core.omega.sigma_probabilistic`: Sigma = (W^T W + eps I)^(1/2) / trace).
After it the newcomer keeps alpha and refreshes w with the new (omega, c) by (**), so the
pair (alpha, w) is always primal-dual consistent.

Many tasks. The server functions (:mod:`fmtl_flower.core.ofmtl_server`, re-exported here) hold
m x m arrays (O(m^3) per step);
:mod:`fmtl_flower.core.ofmtl_factored` has their counterparts for a factored Sigma
(V diag(s) V^T + c I, O(m d^2) per step), and :func:`add_task` runs on either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .losses import Loss, get_loss
from .ofmtl_server import (
    _positive,
    extend_sigma,
    newcomer_server_quantities,
    ofmtl_omega_step,
    omega_from_sigma,
)
from .omega import DEFAULT_OMEGA_EPS
from .rng import coordinate_order
from .sdca import _sdca_kernel

if TYPE_CHECKING:  # annotations only: a device's newcomer imports neither it nor scipy
    from .factored import FactoredMatrix

__all__ = [
    "NewcomerFit",
    "extend_sigma",
    "newcomer_dual",
    "newcomer_duality_gap",
    "newcomer_fit",
    "newcomer_model",
    "newcomer_primal",
    "newcomer_sdca",
    "newcomer_server_quantities",
    "ofmtl_omega_step",
    "omega_from_sigma",
]


# ----------------------------------------------------------------------------- validation


def _data(X: np.ndarray, y: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    X = np.ascontiguousarray(X, dtype=np.float64)
    if X.ndim != 2:
        raise ValueError(f"X must be a 2-D array (n, d), got shape {X.shape}")
    if y is not None:
        y = np.ascontiguousarray(y, dtype=np.float64)
        if y.shape != (X.shape[0],):
            raise ValueError(f"y must have shape ({X.shape[0]},), got {y.shape}")
        if not np.all((y == 1.0) | (y == -1.0)):
            raise ValueError("y must contain labels in {-1, +1}")
    return X, y


def _vector(v: np.ndarray, size: int, arg: str) -> np.ndarray:
    v = np.ascontiguousarray(v, dtype=np.float64)
    if v.shape != (size,):
        raise ValueError(f"{arg} must have shape ({size},), got {v.shape}")
    if not np.all(np.isfinite(v)):
        raise ValueError(f"{arg} has non-finite entries")
    return v


def _dual_feasible(alpha: np.ndarray, y: np.ndarray, loss: Loss, tol: float = 1e-12) -> None:
    if not loss.feasible(alpha, y, tol):
        lo, hi = loss.dual_domain
        raise ValueError(f"alpha must satisfy {lo:g} <= y_i * alpha_i <= {hi:g} (the dual "
                         f"domain of the {loss.name} loss)")


def _clip_to_domain(alpha: np.ndarray, y: np.ndarray, loss: Loss) -> np.ndarray:
    """``alpha`` with every y_i alpha_i clipped exactly into the loss's dual domain (a
    coordinate step's alpha_old + (alpha_new - alpha_old) can miss a bound by one ulp)."""
    lo, hi = loss.dual_domain
    return y * np.clip(y * alpha, lo, hi)


# ----------------------------------------------------------------------------- newcomer


def newcomer_model(X: np.ndarray, alpha: np.ndarray, *, omega: float, c: np.ndarray,
                   lam: float) -> np.ndarray:
    """The newcomer's model w(alpha) = (X^T alpha / n - lam c) / (lam omega), eq. (**).

    Parameters
    ----------
    X : ndarray of shape (n, d)
        The newcomer's training samples (rows).
    alpha : ndarray of shape (n,)
        Dual variables (0 <= y_i alpha_i <= 1; not checked here).
    omega : float
        Omega[m, m] of the extended Omega (> 0); see the module docstring for other K.
    c : ndarray of shape (d,)
        sum_{t<m} Omega[t, m] w_t.
    lam : float
        lambda (> 0), the formulation's (K = lam Omega).

    Returns
    -------
    ndarray of shape (d,)
        The unique minimiser of the Lagrangian in w; ``-c / omega`` when n = 0.
    """
    X, _ = _data(X)
    n, d = X.shape
    omega = _positive(omega, "omega")
    lam = _positive(lam, "lam")
    alpha = _vector(alpha, n, "alpha")
    c = _vector(c, d, "c")
    b = X.T @ alpha / n if n else np.zeros(d)
    return (b - lam * c) / (lam * omega)


def newcomer_sdca(X: np.ndarray, y: np.ndarray, alpha: np.ndarray, w: np.ndarray, *,
                  omega: float, lam: float, budget: int, order: np.ndarray,
                  sqnorm: np.ndarray | None = None, loss: str | Loss = "hinge") -> np.ndarray:
    """Run ``budget`` exact SDCA coordinate steps on the newcomer's dual D_new.

    Parameters
    ----------
    X : ndarray of shape (n, d)
        The newcomer's training samples.
    y : ndarray of shape (n,)
        Labels in {-1, +1}.
    alpha : ndarray of shape (n,)
        Current dual variables, 0 <= y_i alpha_i <= 1. Not modified.
    w : ndarray of shape (d,)
        ``newcomer_model(X, alpha, omega=omega, c=c, lam=lam)``: the model consistent with
        ``alpha``. The steps only need w and omega (c enters through w); an inconsistent w
        makes them steps of a different problem.
    omega : float
        Omega[m, m] (> 0).
    lam : float
        lambda (> 0).
    budget : int
        Number of coordinate steps (>= 0); step s visits ``order[s % n]``.
    order : ndarray of shape (n,), int64
        A permutation of 0..n-1 (e.g. :func:`fmtl_flower.core.rng.coordinate_order`).
    sqnorm : ndarray of shape (n,), optional
        Precomputed squared row norms of X.
    loss : str or Loss, default "hinge"
        The loss l of P_new (:func:`fmtl_flower.core.losses.get_loss`; module docstring).

    Returns
    -------
    ndarray of shape (n,)
        The updated dual variables; y_i alpha_i lies in the loss's dual domain exactly
        ([0, 1] for the hinge). Zero-norm rows that are visited get y_i alpha_i = argmax D
        (their exact coordinate maximiser: 1 for the hinge).
    """
    X, y = _data(X, y)
    n, d = X.shape
    loss = get_loss(loss)
    omega = _positive(omega, "omega")
    lam = _positive(lam, "lam")
    alpha = _vector(alpha, n, "alpha")
    w = _vector(w, d, "w")
    _dual_feasible(alpha, y, loss)
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    order = np.ascontiguousarray(order, dtype=np.int64)
    if order.shape != (n,):
        raise ValueError(f"order must have shape ({n},), got {order.shape}")
    if sqnorm is None:
        sqnorm = np.einsum("ij,ij->i", X, X)
    new_alpha = alpha.copy()
    if n == 0 or budget == 0:
        return new_alpha
    v = w.copy()
    # MOCHA's kernel with m_tt sigma' = 1 / (lam omega), run directly on alpha (its d_alpha
    # accumulator) from a zero base, with v = w(alpha) kept up to date by the kernel.
    _sdca_kernel(X, y, np.zeros(n), sqnorm, w, order, int(budget), 1.0 / (lam * omega),
                 new_alpha, v, loss.code)  # visited zero-norm rows: the kernel's zero-row rule
    return _clip_to_domain(new_alpha, y, loss)


def newcomer_primal(X: np.ndarray, y: np.ndarray, w: np.ndarray, *, omega: float,
                    c: np.ndarray, lam: float, loss: str | Loss = "hinge") -> float:
    """P_new(w) = mean l(y_i x_i^T w) + (lam/2) omega |w|^2 + lam c^T w (0 loss term when
    n = 0), l the ``loss`` (the hinge by default)."""
    X, y = _data(X, y)
    d = X.shape[1]
    loss = get_loss(loss)
    omega, lam = _positive(omega, "omega"), _positive(lam, "lam")
    w, c = _vector(w, d, "w"), _vector(c, d, "c")
    data = loss.mean_value(X, y, w)
    return data + 0.5 * lam * omega * float(w @ w) + lam * float(c @ w)


def newcomer_dual(X: np.ndarray, y: np.ndarray, alpha: np.ndarray, *, omega: float,
                  c: np.ndarray, lam: float, loss: str | Loss = "hinge") -> float:
    """D_new(alpha) = (1/n) sum D(y_i alpha_i) - |X^T alpha / n - lam c|^2 / (2 lam omega),
    D = -l*(-.) the ``loss``'s dual term (D(a) = a for the hinge).

    Raises ``ValueError`` if alpha is outside the loss's dual domain (where D_new is -inf).
    """
    X, y = _data(X, y)
    n = X.shape[0]
    loss = get_loss(loss)
    alpha = _vector(alpha, n, "alpha")
    _dual_feasible(alpha, y, loss)
    w = newcomer_model(X, alpha, omega=omega, c=c, lam=lam)
    return loss.dual_mean(alpha, y) - 0.5 * float(lam) * float(omega) * float(w @ w)


def newcomer_duality_gap(X: np.ndarray, y: np.ndarray, alpha: np.ndarray, *, omega: float,
                         c: np.ndarray, lam: float, loss: str | Loss = "hinge") -> float:
    """P_new(w(alpha)) - D_new(alpha) >= 0 for the consistent pair (w(alpha), alpha).

    Computed as mean l(y_i x_i^T w) - mean D(y_i alpha_i) + w^T b (b = X^T alpha / n), which
    equals the difference of :func:`newcomer_primal` and :func:`newcomer_dual` without their
    cancelling quadratic terms (r(w) + r*(b) = w^T b at w = w(alpha)); each sample's
    l(z_i) - D(a_i) + a_i z_i >= 0 (Fenchel-Young), so the gap is a certificate for any
    registered ``loss``.
    """
    X, y = _data(X, y)
    n = X.shape[0]
    loss = get_loss(loss)
    alpha = _vector(alpha, n, "alpha")
    _dual_feasible(alpha, y, loss)
    w = newcomer_model(X, alpha, omega=omega, c=c, lam=lam)
    if n == 0:
        return 0.0
    b = X.T @ alpha / n
    return loss.mean_value(X, y, w) - loss.dual_mean(alpha, y) + float(w @ b)


@dataclass
class NewcomerFit:
    """Result of :func:`newcomer_fit`.

    Attributes
    ----------
    alpha : ndarray of shape (n,)
        Dual variables (keep them: the next fit after an Omega-step starts from them).
    w : ndarray of shape (d,)
        ``newcomer_model(X, alpha, ...)``, the consistent model.
    gaps : ndarray of shape (rounds + 1,)
        Duality gap before the first round and after each round (empty if not tracked).
    duals : ndarray of shape (rounds + 1,)
        D_new at the same points (non-decreasing; empty if not tracked).
    """

    alpha: np.ndarray
    w: np.ndarray
    gaps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    duals: np.ndarray = field(default_factory=lambda: np.zeros(0))


def newcomer_fit(X: np.ndarray, y: np.ndarray, *, omega: float, c: np.ndarray, lam: float,
                 rounds: int, local_frac: float, seed: int, task_id: int,
                 alpha: np.ndarray | None = None, first_round: int = 1,
                 track_gap: bool = True, loss: str | Loss = "hinge") -> NewcomerFit:
    """Solve the newcomer's subproblem by rounds of SDCA, each followed by the refresh (**).

    Round r (r = first_round, ..., first_round + rounds - 1) runs
    H = floor(local_frac * n) steps in the order ``coordinate_order(seed, task_id, r, n)``,
    then sets w = newcomer_model(X, alpha, ...). OFMTL's inner loop (reference: 100 rounds,
    local_frac 0.5) between two Omega-steps is one call; pass the previous ``alpha`` to
    continue after an Omega-step with the new (omega, c).

    Parameters
    ----------
    X, y : the newcomer's data, shapes (n, d) and (n,), labels in {-1, +1}.
    omega, c, lam : the subproblem's constants (module docstring, (*)).
    rounds : int
        Number of rounds (>= 0).
    local_frac : float
        Steps per round as a fraction of n (> 0; > 1 revisits coordinates).
    seed, task_id : int
        Keys of the coordinate orders (design decision 5).
    alpha : ndarray of shape (n,), optional
        Starting dual variables (default 0).
    first_round : int
        Round number of the first round (keys its coordinate order).
    track_gap : bool
        Record the duality gap and the dual value after every round (O(n d) each).
    loss : str or Loss, default "hinge"
        The loss l of P_new (the run's ``mocha.loss``).

    Returns
    -------
    NewcomerFit
    """
    X, y = _data(X, y)
    n, d = X.shape
    loss = get_loss(loss)
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    if not local_frac > 0:
        raise ValueError(f"local_frac must be > 0, got {local_frac}")
    alpha = np.zeros(n) if alpha is None else _vector(alpha, n, "alpha").copy()
    _dual_feasible(alpha, y, loss)
    kw = {"omega": omega, "c": c, "lam": lam}
    w = newcomer_model(X, alpha, **kw)
    sqnorm = np.einsum("ij,ij->i", X, X)
    budget = int(np.floor(local_frac * n))
    gaps, duals = [], []

    def record() -> None:
        if track_gap:
            gaps.append(newcomer_duality_gap(X, y, alpha, **kw, loss=loss))
            duals.append(newcomer_dual(X, y, alpha, **kw, loss=loss))

    record()
    for r in range(first_round, first_round + rounds):
        order = coordinate_order(seed, task_id, r, n)
        alpha = newcomer_sdca(X, y, alpha, w, omega=omega, lam=lam, budget=budget,
                              order=order, sqnorm=sqnorm, loss=loss)
        w = newcomer_model(X, alpha, **kw)
        record()
    return NewcomerFit(alpha=alpha, w=w, gaps=np.array(gaps), duals=np.array(duals))


# ----------------------------------------------------------------------------- driver


@dataclass
class NewTaskResult:
    """Result of :func:`add_task`: the federation's state after one newcomer joined.

    Attributes
    ----------
    W : ndarray of shape (d, m + 1)
        ``[W_old, w]``: the old columns bit for bit, the newcomer's model last.
    Sigma : ndarray of shape (m + 1, m + 1), or FactoredMatrix
        The Sigma the newcomer's final SDCA rounds used (unit trace): the extension when
        ``outer == 1``, else the Omega-step of ``[W_old, w]`` after outer iteration
        ``outer - 1``. ``w`` is (up to the final duality gap) the minimiser of the newcomer's
        subproblem for this Sigma; no Omega-step follows the last iteration. A
        :class:`~fmtl_flower.core.factored.FactoredMatrix` when ``Sigma_old`` was one.
    Omega : ndarray of shape (m + 1, m + 1), or FactoredMatrix
        ``omega_from_sigma(Sigma)`` (its factored form when Sigma is factored).
    alpha : ndarray of shape (n,)
        The newcomer's dual variables (they never leave the device).
    gaps : ndarray of shape (outer,)
        Duality gap of the newcomer's subproblem at the end of each outer iteration (for
        that iteration's omega and c).
    primals : ndarray of shape (outer,)
        The reference code's objective ``compute_primal_ofmtl`` at the end of each outer
        iteration: the newcomer's mean hinge loss + (lam/2) tr(W Omega W^T) over all m + 1
        columns, with that iteration's Omega (so it is P_new plus terms of the frozen
        columns).
    ws : ndarray of shape (outer, d)
        The newcomer's model after each outer iteration (what it sent to the server).
    omega : float
    c : ndarray of shape (d,)
        The last server message, the subproblem of the returned ``w``.
    floats_sent : int
        Server -> device: (d + 1) floats (omega and c) per outer iteration.
    floats_received : int
        Device -> server: d floats (w) per outer iteration.
    messages : int
        Round trips (= ``outer``); none involves an old device.
    """

    W: np.ndarray
    Sigma: np.ndarray | FactoredMatrix
    Omega: np.ndarray | FactoredMatrix
    alpha: np.ndarray
    gaps: np.ndarray
    primals: np.ndarray
    ws: np.ndarray
    omega: float
    c: np.ndarray
    floats_sent: int
    floats_received: int
    messages: int

    @property
    def w(self) -> np.ndarray:
        """The newcomer's model, ``W[:, -1]``."""
        return self.W[:, -1]

    @property
    def floats_communicated(self) -> int:
        """``floats_sent + floats_received`` = outer (2 d + 1), whatever m."""
        return self.floats_sent + self.floats_received


def _newcomer_rounds(X: np.ndarray, y: np.ndarray, sqnorm: np.ndarray, alpha: np.ndarray, *,
                     omega: float, c: np.ndarray, lam: float, rounds: int, budget: int,
                     seed: int, task_id: int, first_round: int, loss: Loss
                     ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`newcomer_fit` (``track_gap=False``) for validated inputs, bit for bit.

    The same coordinate orders, kernel calls (with their zero-row rule), clipping and model
    refresh (:func:`newcomer_sdca`, :func:`newcomer_model`), without re-validating the arrays every
    round (O(n) checks that would cost more than the round's steps on small tasks), so that
    timing the driver measures the protocol rather than the checks. Returns (alpha, w).
    """
    n = X.shape[0]
    omega, lam = float(omega), float(lam)
    scale = 1.0 / (lam * omega)
    alpha = np.array(alpha, dtype=np.float64, copy=True)
    w = (X.T @ alpha / n - lam * c) / (lam * omega)
    zeros = np.zeros(n)
    for r in range(first_round, first_round + rounds):
        order = coordinate_order(seed, task_id, r, n)
        new_alpha = alpha.copy()
        if budget > 0:
            _sdca_kernel(X, y, zeros, sqnorm, w, order, budget, scale, new_alpha, w.copy(),
                         loss.code)
            new_alpha = _clip_to_domain(new_alpha, y, loss)
        alpha = new_alpha
        w = (X.T @ alpha / n - lam * c) / (lam * omega)
    return alpha, w


def add_task(W_old: np.ndarray, Sigma_old: np.ndarray | FactoredMatrix, X: np.ndarray,
             y: np.ndarray, *,
             lam: float, outer: int = 10, inner: int = 100, local_frac: float = 0.5,
             omega_eps: float = DEFAULT_OMEGA_EPS, seed: int = 0,
             task_id: int = 0, loss: str | Loss = "hinge") -> NewTaskResult:
    """One newcomer joins m trained tasks: OFMTL's protocol, centrally and without Flower.

    1. Sigma = :func:`extend_sigma` (Sigma_old), Omega = Sigma^-1, alpha = 0, w = 0.
    2. For k = 0 .. outer - 1: the server sends (omega, c) =
       :func:`newcomer_server_quantities` (W_old, Omega); the newcomer continues its SDCA
       from alpha for ``inner`` rounds of ``floor(local_frac * n)`` steps
       (:func:`newcomer_fit` with ``first_round = k * inner + 1``, the coordinate orders of
       rounds k inner + 1 .. (k + 1) inner) and sends w = w(alpha) back; the server puts it
       in column m and, **except after the last iteration**, takes the Omega-step
       (:func:`ofmtl_omega_step`) over all m + 1 columns, the old ones frozen.

    Why no final Omega-step (the reference code takes one after every outer iteration):
    as in :func:`fmtl_flower.centralized.fit_mocha` (``omega_step_due``), the returned pair
    is consistent -- w solves the newcomer's subproblem for the returned Sigma -- rather
    than leaving a Sigma that the dual variables never saw; the next newcomer's extension
    starts from exactly the Sigma the models were trained with. It also saves the server's
    last message: outer round trips of (d + 1) floats down and d up.

    The computation is the one the Flower strategy and client perform (same rounds, orders
    and arithmetic), so it serves as their parity reference.

    A factored ``Sigma_old`` (:class:`~fmtl_flower.core.factored.FactoredMatrix`) runs the
    server steps of :mod:`fmtl_flower.core.ofmtl_factored` instead (O(m d^2) per round trip,
    no m x m array; the same W and Sigma to rounding); a dense one runs the functions above.

    Parameters
    ----------
    W_old : ndarray of shape (d, m)
        The frozen models of the m present tasks (m = 0 allowed: a first task).
    Sigma_old : ndarray of shape (m, m), or FactoredMatrix (m x m)
        Their task covariance, symmetric positive semidefinite with unit trace.
    X : ndarray of shape (n, d)
    y : ndarray of shape (n,), labels in {-1, +1}
        The newcomer's training data (n >= 1).
    lam : float
        lambda (> 0) of the probabilistic formulation (K = lam Omega).
    outer : int
        Round trips (>= 1; reference 10).
    inner : int
        SDCA rounds on the device per round trip (>= 0; reference 100).
    local_frac : float
        Coordinate steps per round as a fraction of n (> 0; reference 0.5).
    omega_eps : float
        Relative eigenvalue floor of the Omega-step.
    seed, task_id : int
        Keys of the coordinate orders; ``task_id`` is the newcomer's task index (m when
        tasks are numbered by arrival).
    loss : str or Loss, default "hinge"
        The loss of the newcomer's subproblem (and of ``primals``).

    Returns
    -------
    NewTaskResult

    Raises
    ------
    ValueError
        On shapes that do not fit, non-finite values, labels outside {-1, +1}, an invalid
        Sigma_old (see :func:`extend_sigma`) or invalid counts.
    """
    W_old = np.array(W_old, dtype=np.float64)  # a copy: the caller's array is never touched
    if W_old.ndim != 2:
        raise ValueError(f"W_old must be a 2-D array (d, m), got shape {W_old.shape}")
    if not np.all(np.isfinite(W_old)):
        raise ValueError("W_old has non-finite entries")
    d, m = W_old.shape
    X, y = _data(X, y)
    if X.shape[1] != d:
        raise ValueError(f"X has {X.shape[1]} features, W_old has d = {d}")
    if X.shape[0] < 1:
        raise ValueError("the newcomer needs at least one training sample")
    if not np.all(np.isfinite(X)):
        raise ValueError("X has non-finite entries")
    from .ofmtl_factored import server_ops  # the server's side (scipy): not on a device

    ops = server_ops(Sigma_old)
    shape = np.shape(Sigma_old)
    if shape != (m, m):
        raise ValueError(f"Sigma_old must have shape ({m}, {m}), got {shape}")
    lam = _positive(lam, "lam")
    loss = get_loss(loss)
    for name, value, low in (("outer", outer, 1), ("inner", inner, 0)):
        if isinstance(value, bool) or int(value) != value or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    outer, inner = int(outer), int(inner)
    if not local_frac > 0:
        raise ValueError(f"local_frac must be > 0, got {local_frac}")

    sigma = ops.extend_sigma(Sigma_old)
    omega_mat = ops.omega_from_sigma(sigma)
    W = np.zeros((d, m + 1))
    W[:, :m] = W_old
    alpha = np.zeros(X.shape[0])
    gaps, primals, ws = np.zeros(outer), np.zeros(outer), np.zeros((outer, d))
    omega, c = 0.0, np.zeros(d)
    sqnorm = np.einsum("ij,ij->i", X, X)
    budget = int(np.floor(local_frac * X.shape[0]))
    for k in range(outer):
        omega, c = ops.newcomer_server_quantities(W_old, omega_mat)
        alpha, w = _newcomer_rounds(X, y, sqnorm, alpha, omega=omega, c=c, lam=lam,
                                    rounds=inner, budget=budget, seed=seed, task_id=task_id,
                                    first_round=k * inner + 1, loss=loss)
        W[:, m] = w
        ws[k] = w
        gaps[k] = newcomer_duality_gap(X, y, alpha, omega=omega, c=c, lam=lam, loss=loss)
        primals[k] = loss.mean_value(X, y, w) + 0.5 * lam * ops.quad_trace(W, omega_mat)
        if k < outer - 1:
            sigma, omega_mat = ops.omega_step(W, omega_eps)
    return NewTaskResult(W=W, Sigma=sigma, Omega=omega_mat, alpha=alpha, gaps=gaps,
                         primals=primals, ws=ws, omega=float(omega), c=c,
                         floats_sent=outer * (d + 1), floats_received=outer * d,
                         messages=outer)


__all__ += ["NewTaskResult", "add_task"]
