"""FSVRG and its baselines on sparse L2-regularised logistic regression (numerics only).

Konečný, McMahan, Ramage, Richtárik, "Federated Optimization: Distributed Machine Learning for
On-Device Intelligence" (2016): Algorithm 4 (FSVRG), Algorithm 3 (naive FSVRG), Algorithm 2
(DANE), and the paper's baselines distributed gradient descent and CoCoA+. This module never
imports ``flwr``; the Flower strategy/client pair calls the functions below and moves the
named quantities over the wire.

Problem and normalisation
-------------------------
Node ``k`` holds ``n_k`` rows ``x_i`` (a scipy CSR matrix ``X_k``, float64) with labels
``y_i in {-1, +1}`` (float64); ``n = sum_k n_k``. The objective is the paper's (1)/(7) with
``f_i(w) = l_i(w) + (lam/2) |w|^2`` and the logistic loss ``l_i(w) = log(1 + exp(-y_i x_i^T w))``::

    f(w) = (1/n) sum_i log(1 + exp(-y_i x_i^T w)) + (lam/2) |w|^2
         = sum_k (n_k/n) F_k(w),   F_k(w) = (1/n_k) sum_{i in P_k} l_i(w) + (lam/2) |w|^2.

The paper's experiment uses ``lam = 1/n``. The same minimiser is found by scikit-learn's
``LogisticRegression(fit_intercept=False, C=1/(lam*n))``, whose objective
``C sum_i l_i(w) + |w|^2/2`` equals ``f(w)/lam``. Losses and derivatives are evaluated stably
(``logaddexp`` / branch on the sign of the margin; no overflow for any margin).

The sparsity statistics (section 3.6.1), federated
--------------------------------------------------
``n_k^j`` = rows of node ``k`` whose feature ``j`` is nonzero; ``n^j = sum_k n_k^j``;
``phi^j = n^j/n``; ``phi_k^j = n_k^j/n_k``; ``s_k^j = phi^j/phi_k^j`` (``:= 1`` where
``n_k^j = 0``); ``omega^j = #{k : n_k^j > 0}``; ``a^j = K/omega^j`` (``:= 1`` where
``omega^j = 0``), with ``K`` the number of nodes that reported counts. ``S_k = Diag(s_k)``,
``A = Diag(a)``. Computed once, before round 1:

* node: :func:`node_feature_counts` ``(X_k) -> (n_k, counts_k)`` (an int and ``d`` ints; no
  raw data leaves the node);
* server: :class:`FeatureCountAccumulator` (streaming ``add(n_k, counts_k)``, then
  ``result()``) or :func:`combine_feature_counts` (all at once) ``-> FeatureStats`` with
  ``n, n_j, omega, phi, a``;
* ``s_k``: :func:`node_scaling` ``(phi, n_k, counts_k)``. Either the server broadcasts
  ``phi`` (``d`` floats, the same for all nodes) and each node computes its own ``s_k`` (what
  we recommend: the node already has its counts), or the server computes it with
  :meth:`FeatureStats.node_scaling` from the counts it received and sends it.

FSVRG round (Algorithm 4), two message round trips
---------------------------------------------------
1. node: :func:`local_loss_grad_sums` ``(X_k, y_k, w_t) -> (loss_sum_k, grad_sum_k)``;
   server: ``g = global_gradient(w_t, sum_k grad_sum_k, n, lam)`` (``= grad f(w_t)``; the
   loss sums give ``f(w_t)`` via :func:`global_objective` for free).
2. node: ``order = coordinate_order(seed, task_id, round, n_k)`` and
   :func:`fsvrg_local_pass` ``(X_k, y_k, w_t, g, lam=, h=, s=s_k, order=) -> w_k``;
   server: :func:`fsvrg_aggregate` ``(w_t, [w_k], [n_k], a, n=n) -> w_{t+1}``
   ``= w_t + A sum_k (n_k/n)(w_k - w_t)``.

The local pass (lines 5-9, with ``h_k = h/n_k``, one pass over a random permutation)::

    w_k <- w_k - h_k ( S_k [grad l_i(w_k) - grad l_i(w_t)] + lam (w_k - w_t) + grad f(w_t) ).

**Where S_k applies.** The paper writes ``S_k [grad f_i(w_k) - grad f_i(w_t)]`` with ``f_i``
including the regulariser. We scale only the loss part (issue 6): ``S_k`` corrects how often
feature ``j`` appears in node ``k``'s rows relative to the whole data set, and the
regulariser's difference ``lam (w_k - w_t)`` is dense and identical on every node, so there is
nothing to correct. (With ``S_k = I`` both readings coincide.)

**Naive FSVRG (Algorithm 3).** :func:`naive_fsvrg_local_pass`: the same update with
``S_k = I`` and the stepsize ``h`` itself (not ``h/n_k``); ``m`` steps on rows sampled
uniformly at random (:func:`uniform_sample_order`, or a permutation: any index sequence is
accepted); server: :func:`naive_fsvrg_aggregate` ``w_t + (1/K) sum_k (w_k - w_t)``.

Baselines
---------
* **GD** (one round trip): node :func:`local_loss_grad_sums`; server
  :func:`global_gradient` and :func:`gd_step` ``w - step * grad``. Default step ``1/L`` with
  ``L = sigma_max(X)^2 / (4n) + lam`` (:func:`gd_smoothness`; the logistic loss has
  ``l'' <= 1/4``, so ``L`` bounds the Hessian ``X^T D X / n + lam I`` everywhere), where
  ``sigma_max(X)^2 = lambda_max(sum_k X_k^T X_k)`` of the pooled rows is estimated federatedly
  before round 1 by power iteration on the pooled Gram operator: the server sends a unit
  ``v`` (start :func:`gram_power_start`), node :func:`local_gram_product`
  ``X_k^T (X_k v)``, server sums to ``u = X^T X v`` and takes :func:`power_estimate`
  ``|u|^2 / (v . u)`` and ``v <- u / |u|``, until the estimate grows by less than
  ``GD_POWER_TOL`` (relative) or after ``GD_POWER_MAX_ITER`` round trips. Each estimate is
  the Rayleigh quotient of ``X^T X`` at ``(X^T X)^(1/2) v``, so it never exceeds
  ``sigma_max^2`` and never decreases: the step is at least ``1/L`` (``1/L`` once converged;
  GD is stable below ``2/L``). Measured on ``sparse-federated`` (seed 0), from the Gaussian
  start: 0.05, 0.96, 0.9997, 1.0000 of ``sigma_max^2`` at K = 50 (4 round trips), 0.02, 0.15,
  0.88, 0.998, 1.0000 at K = 1000 (5).
* **CoCoA+** (one round trip; Ma et al. 2015, adding, ``gamma = 1``, ``sigma' = K``): node
  keeps its dual variables ``alpha_k`` (``y_i alpha_i in [0, 1]``, start at 0) and runs
  :func:`cocoa_plus_local_sdca` ``(X_k, y_k, alpha_k, w, lam=, n=, sigma_prime=K, order=)
  -> (d_alpha_k, d_w_k)`` (SDCA on the logistic dual subproblem, each coordinate maximised by
  safeguarded Newton steps); it commits ``alpha_k += d_alpha_k`` when the server accepts the
  round; server: :func:`cocoa_plus_aggregate` ``(w, sum_k d_w_k) -> w + gamma sum_k d_w_k``.
  The primal point is ``w(alpha) = (1/(lam n)) sum_i alpha_i x_i``. Duality gap:
  node :func:`logistic_dual_sum` ``(y_k, alpha_k)`` (and :func:`local_loss_grad_sums` for the
  primal); server :func:`dual_objective` ``(w, sum_k dual_sum_k, n, lam)`` and
  ``gap = global_objective(...) - dual_objective(...) >= 0``.
* **DANE** (two round trips; Algorithm 2): round trip 1 as FSVRG's; node
  :func:`dane_local_solve` ``(X_k, y_k, w_t, g, lam=, step=, orders=, eta=1, mu=0) -> w_k``
  solves the local subproblem (10) approximately with ``len(orders)`` SVRG epochs started at
  ``w_t`` (:func:`dane_epoch_orders` gives the permutations); server :func:`dane_aggregate`
  ``(1/K) sum_k w_k``. With one epoch, ``eta = 1``, ``mu = 0`` and the same order it is
  exactly the naive FSVRG pass (Proposition 1; tested).

Evaluation: node :func:`local_error_count` ``(X_test, y_test, w) -> (wrong, n)``;
:func:`relative_suboptimality` ``(f(w) - f*) / |f*|`` against the scikit-learn optimum.

Stepsizes (measured on ``sparse-federated``, K = 1000, d = 20,000, ``lam = 1/n``, seed 0)
-----------------------------------------------------------------------------------------
FSVRG: ``h = 16`` is the best of 8, 16, 32 (30 rounds: 6.4e-2, 2.6e-2, 8.2e-2; ``h = 32``
oscillates, and on earlier versions of the data ``h >= 64`` diverged on non-IID nodes while the
IID reshuffle tolerated it). Why: a node that lacks feature ``j``
still moves ``w_j`` by ``-h g_j`` (the dense ``grad f(w_t)`` term) and ``A`` multiplies the
average of these moves by ``K / omega^j``, so rare features see an effective step of about
``h K / omega^j``. With ``h = 16``: relative sub-optimality 2.6e-2 after 30 rounds, 1e-3 after
105 rounds (210 round trips); test error at the optimum's level (26 %) within ~30 rounds.
GD with ``step = 1/L``, ``L = sigma_max(X)^2 / (4n) + lam = 0.41``: 1.2e-1 after 1000 rounds.

Randomness (design decision 5)
------------------------------
Every random choice is an explicit index array: per-(seed, task, round) permutations from
:func:`~fmtl_flower.core.rng.coordinate_order`, or :func:`uniform_sample_order` /
:func:`dane_epoch_orders` (numpy Generators seeded ``[seed, task, round, tag(, epoch)]``).

Implementation
--------------
The passes are numba kernels over ``(indptr, indices, data)``. A step touches only the row's
nonzeros: the dense part of the update (``-h_k (lam w + G)`` with the fixed vector ``G``) is
kept implicit by writing the iterate as ``w = alpha v + beta G`` with scalars ``alpha, beta``
(``v`` is rescaled when ``alpha`` underflows), so one step costs ``O(nnz(x_i))``, not
``O(d)``. :func:`fsvrg_local_pass_reference` is the straightforward scipy-per-row loop
(``O(d)`` per step) used by the tests and the benchmark.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp

from fmtl_flower.core.jit import kernel
from fmtl_flower.core.rng import (
    TAG_DANE_EPOCH,
    TAG_GD_POWER,
    TAG_UNIFORM_SAMPLE,
    coordinate_order,
)

__all__ = [
    "GD_POWER_MAX_ITER",
    "GD_POWER_TOL",
    "TAG_DANE_EPOCH",
    "TAG_GD_POWER",
    "TAG_UNIFORM_SAMPLE",
    "FeatureCountAccumulator",
    "FeatureStats",
    "aggregation_weights",
    "cocoa_plus_aggregate",
    "cocoa_plus_local_sdca",
    "combine_feature_counts",
    "dane_aggregate",
    "dane_epoch_orders",
    "dane_local_solve",
    "default_dane_step",
    "dual_objective",
    "fsvrg_aggregate",
    "fsvrg_local_pass",
    "fsvrg_local_pass_reference",
    "gd_smoothness",
    "gd_step",
    "gram_power_start",
    "global_gradient",
    "global_objective",
    "local_error_count",
    "local_gram_product",
    "local_loss_grad_sums",
    "logistic_dual_sum",
    "logistic_loss_grad",
    "logistic_objective",
    "naive_fsvrg_aggregate",
    "naive_fsvrg_local_pass",
    "node_feature_counts",
    "node_scaling",
    "power_estimate",
    "primal_from_dual",
    "relative_suboptimality",
    "uniform_sample_order",
]


#: ``alpha`` below this in the implicit iterate ``w = alpha v + beta G`` triggers a rescale.
_RESCALE_BELOW = 1e-120


# --------------------------------------------------------------------------------------------
# validation


def _as_csr(X: Any, name: str = "X") -> sp.csr_matrix:
    """``X`` as a float64 CSR matrix (no copy when it already is one)."""
    if not sp.issparse(X):
        arr = np.asarray(X)
        if arr.ndim != 2:
            raise ValueError(f"{name} must be a 2-D (sparse) matrix, got shape {arr.shape}")
        X = arr
    Xc = sp.csr_matrix(X, dtype=np.float64)
    if not np.all(np.isfinite(Xc.data)):
        raise ValueError(f"{name} has non-finite entries")
    return Xc


def _as_labels(y: Any, n: int, name: str = "y") -> np.ndarray:
    ya = np.ascontiguousarray(np.asarray(y, dtype=np.float64).reshape(-1))
    if ya.shape[0] != n:
        raise ValueError(f"{name} has {ya.shape[0]} labels but X has {n} rows")
    if ya.size and not np.all(np.abs(ya) == 1.0):
        bad = np.unique(ya[np.abs(ya) != 1.0])[:5]
        raise ValueError(f"{name} must be in {{-1, +1}}, found {bad.tolist()}")
    return ya


def _as_vector(v: Any, d: int, name: str) -> np.ndarray:
    va = np.ascontiguousarray(np.asarray(v, dtype=np.float64).reshape(-1))
    if va.shape[0] != d:
        raise ValueError(f"{name} must have length {d}, got {va.shape[0]}")
    if not np.all(np.isfinite(va)):
        raise ValueError(f"{name} has non-finite entries")
    return va


def _as_order(order: Any, n: int, name: str = "order") -> np.ndarray:
    o = np.ascontiguousarray(np.asarray(order).reshape(-1))
    if o.size and o.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer row indices, got dtype {o.dtype}")
    o = o.astype(np.int64, copy=False)
    if o.size and (o.min() < 0 or o.max() >= n):
        raise ValueError(f"{name} must index rows 0..{n - 1}, got values in "
                         f"[{o.min()}, {o.max()}]")
    return o


def _positive(value: float, name: str, *, allow_zero: bool = False) -> float:
    v = float(value)
    ok = v >= 0.0 if allow_zero else v > 0.0
    if not (math.isfinite(v) and ok):
        raise ValueError(f"{name} must be finite and {'>=' if allow_zero else '>'} 0, "
                         f"got {value!r}")
    return v


# --------------------------------------------------------------------------------------------
# objective, gradients (node-side sums, server-side combination, centralised convenience)


def _margins(X: sp.csr_matrix, w: np.ndarray) -> np.ndarray:
    return np.asarray(X @ w, dtype=np.float64).reshape(-1)


def _loss_derivative(y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """``d/dz log(1 + exp(-y z)) = -y sigmoid(-y z)``, elementwise and stable."""
    t = y * z
    # sigmoid(-t) = exp(-logaddexp(0, t)); exact to rounding for every t
    return -y * np.exp(-np.logaddexp(0.0, t))


def local_loss_grad_sums(X: Any, y: Any, w: Any) -> tuple[float, np.ndarray]:
    """Node-side: ``sum_i l_i(w)`` and ``sum_i grad l_i(w)`` over the node's rows.

    No regulariser and no division: the server sums these over nodes and calls
    :func:`global_objective` / :func:`global_gradient`. Also DANE's and FSVRG's full-gradient
    message, and GD's only message.

    Parameters
    ----------
    X : scipy sparse matrix (n_k, d)
        The node's rows (converted to float64 CSR).
    y : ndarray (n_k,)
        Labels in {-1, +1}.
    w : ndarray (d,)
        The current global model.

    Returns
    -------
    loss_sum : float
        ``sum_i log(1 + exp(-y_i x_i^T w))`` (0 for an empty node).
    grad_sum : ndarray (d,)
        ``sum_i -y_i sigmoid(-y_i x_i^T w) x_i``.
    """
    X = _as_csr(X)
    ya = _as_labels(y, X.shape[0])
    wa = _as_vector(w, X.shape[1], "w")
    z = _margins(X, wa)
    loss = float(np.sum(np.logaddexp(0.0, -ya * z)))
    grad = np.asarray(X.T @ _loss_derivative(ya, z), dtype=np.float64).reshape(-1)
    return loss, grad


def global_objective(w: Any, loss_sum: float, n: int, lam: float) -> float:
    """Server-side: ``f(w) = loss_sum/n + (lam/2)|w|^2`` from the summed node loss sums."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    wa = np.asarray(w, dtype=np.float64).reshape(-1)
    return float(loss_sum) / n + 0.5 * float(lam) * float(wa @ wa)


def global_gradient(w: Any, grad_sum: Any, n: int, lam: float) -> np.ndarray:
    """Server-side: ``grad f(w) = grad_sum/n + lam w`` from the summed node gradient sums."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    wa = np.asarray(w, dtype=np.float64).reshape(-1)
    g = _as_vector(grad_sum, wa.shape[0], "grad_sum")
    return g / n + float(lam) * wa


def logistic_objective(X: Any, y: Any, w: Any, lam: float) -> float:
    """Centralised ``f(w)`` on pooled data (tests, evaluation; not a federated message)."""
    X = _as_csr(X)
    loss, _ = local_loss_grad_sums(X, y, w)
    return global_objective(w, loss, X.shape[0], lam)


def logistic_loss_grad(X: Any, y: Any, w: Any, lam: float) -> tuple[float, np.ndarray]:
    """Centralised ``(f(w), grad f(w))`` on pooled data."""
    X = _as_csr(X)
    loss, grad = local_loss_grad_sums(X, y, w)
    n = X.shape[0]
    return global_objective(w, loss, n, lam), global_gradient(w, grad, n, lam)


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


def local_error_count(X: Any, y: Any, w: Any) -> tuple[int, int]:
    """Node-side evaluation: ``(#{i : sign(x_i^T w) != y_i}, n_k)``, with sign(0) = -1.

    The server sums both over nodes for the pooled test error (the paper's Figure 2, right).
    """
    X = _as_csr(X)
    ya = _as_labels(y, X.shape[0])
    z = _margins(X, _as_vector(w, X.shape[1], "w"))
    return int(np.sum(np.where(z > 0.0, 1.0, -1.0) != ya)), int(X.shape[0])


def relative_suboptimality(value: float, optimum: float) -> float:
    """``(f(w) - f*) / |f*|``, the convergence measure used for FSVRG (``f* > 0`` here)."""
    if optimum == 0.0:
        raise ValueError("optimum must be nonzero")
    return (float(value) - float(optimum)) / abs(float(optimum))


# --------------------------------------------------------------------------------------------
# sparsity statistics (section 3.6.1)


def node_feature_counts(X: Any) -> tuple[int, np.ndarray]:
    """Node-side: ``(n_k, counts_k)`` with ``counts_k[j] = n_k^j``, rows with ``x_ij != 0``.

    Explicit zeros are not counted; duplicate entries of a row count once (as their sum, if
    nonzero). This and nothing else is sent for the statistics.

    Returns
    -------
    n_k : int
    counts_k : ndarray (d,), int64
    """
    X = _as_csr(X)
    if not X.has_canonical_format:
        X = X.copy()
        X.sum_duplicates()
    nonzero = X.data != 0.0
    counts = np.bincount(X.indices[nonzero], minlength=X.shape[1]).astype(np.int64)
    return int(X.shape[0]), counts


def aggregation_weights(omega: Any, num_nodes: int) -> np.ndarray:
    """``a^j = K / omega^j``, and ``1`` where ``omega^j = 0`` (the diagonal of ``A``)."""
    om = np.asarray(omega, dtype=np.float64).reshape(-1)
    a = np.ones_like(om)
    present = om > 0
    a[present] = float(num_nodes) / om[present]
    return a


def node_scaling(phi: Any, n_k: int, counts_k: Any) -> np.ndarray:
    """``s_k^j = phi^j / phi_k^j = phi^j n_k / n_k^j``, and ``1`` where ``n_k^j = 0``.

    Node-side (from the broadcast ``phi`` and the node's own counts) or server-side.
    """
    ph = np.asarray(phi, dtype=np.float64).reshape(-1)
    c = np.asarray(counts_k).reshape(-1)
    if c.shape != ph.shape:
        raise ValueError(f"counts_k has length {c.shape[0]} but phi has {ph.shape[0]}")
    if np.any(c < 0) or np.any(c > n_k):
        raise ValueError(f"counts_k must be in [0, n_k = {n_k}]")
    s = np.ones_like(ph)
    present = c > 0
    s[present] = ph[present] * float(n_k) / c[present].astype(np.float64)
    return s


@dataclass(frozen=True, eq=False)
class FeatureStats:
    """The server's combination of the nodes' counts (section 3.6.1).

    Attributes
    ----------
    num_nodes : int
        ``K``, the number of nodes that reported.
    n : int
        ``sum_k n_k``.
    n_j : ndarray (d,), int64
        ``n^j``, rows (over all nodes) with feature ``j`` nonzero.
    omega : ndarray (d,), int64
        ``omega^j``, nodes with ``n_k^j > 0``.
    """

    num_nodes: int
    n: int
    n_j: np.ndarray
    omega: np.ndarray

    @property
    def dim(self) -> int:
        """``d``."""
        return int(self.n_j.shape[0])

    @property
    def phi(self) -> np.ndarray:
        """``phi^j = n^j / n`` (float64, ``(d,)``); broadcast it to the nodes for ``s_k``."""
        return self.n_j.astype(np.float64) / float(self.n)

    @property
    def a(self) -> np.ndarray:
        """``a^j = K / omega^j`` (``1`` where ``omega^j = 0``): the diagonal of ``A``."""
        return aggregation_weights(self.omega, self.num_nodes)

    def node_scaling(self, n_k: int, counts_k: Any) -> np.ndarray:
        """``s_k`` of a node from its counts (:func:`node_scaling` with this ``phi``)."""
        return node_scaling(self.phi, n_k, counts_k)


class FeatureCountAccumulator:
    """Server-side, streaming: add each node's ``(n_k, counts_k)``, then :meth:`result`.

    Holds ``O(d)`` numbers whatever ``K`` (so ``K = 10,000`` nodes need no ``K x d`` table).
    """

    def __init__(self, dim: int) -> None:
        if int(dim) < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.dim = int(dim)
        self.num_nodes = 0
        self.n = 0
        self.n_j = np.zeros(self.dim, dtype=np.int64)
        self.omega = np.zeros(self.dim, dtype=np.int64)

    def add(self, n_k: int, counts_k: Any) -> None:
        """Add one node's counts (validated: shape ``(d,)``, integers in ``[0, n_k]``)."""
        n_k = int(n_k)
        if n_k < 0:
            raise ValueError(f"n_k must be >= 0, got {n_k}")
        c = np.asarray(counts_k).reshape(-1)
        if c.shape != (self.dim,):
            raise ValueError(f"counts_k must have shape ({self.dim},), got {c.shape}")
        if c.size and c.dtype.kind not in "iu":
            if not np.all(np.isfinite(c)) or not np.all(c == np.round(c)):
                raise ValueError("counts_k must be integers")
        c = c.astype(np.int64)
        if np.any(c < 0) or np.any(c > n_k):
            raise ValueError(f"counts_k must be in [0, n_k = {n_k}]")
        self.num_nodes += 1
        self.n += n_k
        self.n_j += c
        self.omega += c > 0

    def result(self) -> FeatureStats:
        """The :class:`FeatureStats` of the nodes added so far (``n > 0`` required)."""
        if self.n <= 0:
            raise ValueError("no data: the nodes added so far hold no rows")
        return FeatureStats(self.num_nodes, self.n, self.n_j.copy(), self.omega.copy())


def combine_feature_counts(node_counts: Iterable[tuple[int, Any]]) -> FeatureStats:
    """Server-side: :class:`FeatureStats` from an iterable of ``(n_k, counts_k)`` pairs."""
    acc: FeatureCountAccumulator | None = None
    for n_k, counts_k in node_counts:
        if acc is None:
            acc = FeatureCountAccumulator(np.asarray(counts_k).reshape(-1).shape[0])
        acc.add(n_k, counts_k)
    if acc is None:
        raise ValueError("no node counts given")
    return acc.result()


# --------------------------------------------------------------------------------------------
# the SVRG-type local pass (FSVRG, naive FSVRG, DANE's SVRG epochs)


@kernel(inline="always")
def _dloss(yi, z):  # pragma: no cover - compiled
    """``d/dz log(1 + exp(-yi z)) = -yi sigmoid(-yi z)``, stable."""
    t = yi * z
    if t > 0.0:
        e = math.exp(-t)
        return -yi * e / (1.0 + e)
    return -yi / (1.0 + math.exp(t))


@kernel(boundscheck=False)
def _svrg_pass_kernel(indptr, indices, data, y, order, z_snap, s, use_s, step, reg, G,
                      w):  # pragma: no cover - compiled
    """In place on ``w``: for i in order,
    ``w <- w - step (s * (l'_i(w) - l'_i(snap)) x_i + reg w + G)``.

    ``z_snap[i] = x_i^T snap``. The iterate is kept as ``alpha v + beta G`` (``v`` aliases
    ``w``), so the dense part costs O(1) per step.
    """
    d = w.shape[0]
    rho = 1.0 - step * reg
    alpha = 1.0
    beta = 0.0
    v = w
    for t in range(order.shape[0]):
        i = order[t]
        start = indptr[i]
        stop = indptr[i + 1]
        xv = 0.0
        xg = 0.0
        for p in range(start, stop):
            j = indices[p]
            xv += data[p] * v[j]
            xg += data[p] * G[j]
        z = alpha * xv + beta * xg
        yi = y[i]
        gi = _dloss(yi, z) - _dloss(yi, z_snap[i])
        alpha *= rho
        beta = rho * beta - step
        if alpha < _RESCALE_BELOW:
            for j in range(d):
                v[j] *= alpha
            alpha = 1.0
        if gi != 0.0:
            c = -step * gi / alpha
            if use_s:
                for p in range(start, stop):
                    j = indices[p]
                    v[j] += c * s[j] * data[p]
            else:
                for p in range(start, stop):
                    v[indices[p]] += c * data[p]
    for j in range(d):
        w[j] = alpha * v[j] + beta * G[j]


def _run_pass(X: sp.csr_matrix, y: np.ndarray, order: np.ndarray, snap: np.ndarray,
              s: np.ndarray | None, step: float, reg: float, G: np.ndarray,
              w: np.ndarray) -> None:
    if not (step * reg < 1.0):
        raise ValueError(f"step * regulariser must be < 1, got {step} * {reg}")
    z_snap = _margins(X, snap)
    use_s = s is not None
    s_arr = s if s is not None else np.ones(1)
    data = np.ascontiguousarray(X.data, dtype=np.float64)
    _svrg_pass_kernel(X.indptr, X.indices, data, y, order, z_snap, s_arr, use_s, float(step),
                      float(reg), G, w)


def fsvrg_local_pass(
    X: Any,
    y: Any,
    w_t: Any,
    full_grad: Any,
    *,
    lam: float,
    h: float,
    s: Any,
    order: Any,
) -> np.ndarray:
    """Node-side FSVRG local pass (Algorithm 4, lines 5-9).

    ``w_k = w_t``, then for ``i`` in ``order`` (normally
    ``coordinate_order(seed, task_id, round, n_k)``, one permutation of the rows)::

        w_k <- w_k - (h/n_k) ( s * [grad l_i(w_k) - grad l_i(w_t)] + lam (w_k - w_t) + g )

    with ``g = grad f(w_t)`` from the server. ``s`` scales the loss part only (see the module
    docstring).

    Parameters
    ----------
    X : scipy sparse matrix (n_k, d)
        The node's rows.
    y : ndarray (n_k,)
        Labels in {-1, +1}.
    w_t : ndarray (d,)
        The server's model.
    full_grad : ndarray (d,)
        ``grad f(w_t)`` (:func:`global_gradient`), regulariser included.
    lam : float
        ``lam >= 0``.
    h : float
        The global stepsize ``h > 0``; the local one is ``h_k = h / n_k``.
    s : ndarray (d,) or None
        The diagonal of ``S_k`` (:func:`node_scaling`); ``None`` means ``S_k = I``.
    order : array of int (any length)
        Row indices visited, in order.

    Returns
    -------
    w_k : ndarray (d,)
        The node's final iterate (the node sends it, or ``w_k - w_t``).
    """
    X = _as_csr(X)
    n_k, d = X.shape
    ya = _as_labels(y, n_k)
    wt = _as_vector(w_t, d, "w_t")
    g = _as_vector(full_grad, d, "full_grad")
    lam = _positive(lam, "lam", allow_zero=True)
    h = _positive(h, "h")
    o = _as_order(order, n_k)
    s_arr = None if s is None else _as_vector(s, d, "s")
    w = wt.copy()
    if n_k == 0 or o.size == 0:
        return w
    _run_pass(X, ya, o, wt, s_arr, h / n_k, lam, g - lam * wt, w)
    return w


def naive_fsvrg_local_pass(
    X: Any,
    y: Any,
    w_t: Any,
    full_grad: Any,
    *,
    lam: float,
    h: float,
    order: Any,
) -> np.ndarray:
    """Node-side naive FSVRG (Algorithm 3, lines 5-9): ``S_k = I``, stepsize ``h``.

    ``w_k <- w_k - h (grad f_i(w_k) - grad f_i(w_t) + grad f(w_t))`` for ``i`` in ``order``
    (Algorithm 3 samples ``m`` rows uniformly at random: :func:`uniform_sample_order`).
    """
    X = _as_csr(X)
    n_k, d = X.shape
    ya = _as_labels(y, n_k)
    wt = _as_vector(w_t, d, "w_t")
    g = _as_vector(full_grad, d, "full_grad")
    lam = _positive(lam, "lam", allow_zero=True)
    h = _positive(h, "h")
    o = _as_order(order, n_k)
    w = wt.copy()
    if n_k == 0 or o.size == 0:
        return w
    _run_pass(X, ya, o, wt, None, h, lam, g - lam * wt, w)
    return w


def fsvrg_local_pass_reference(
    X: Any,
    y: Any,
    w_t: Any,
    full_grad: Any,
    *,
    lam: float,
    h: float,
    s: Any,
    order: Any,
) -> np.ndarray:
    """The same pass as :func:`fsvrg_local_pass`, as a plain scipy-per-row loop.

    Each step slices the row from the CSR matrix and updates the dense iterate (``O(d)`` per
    step). For tests and the speed benchmark only.
    """
    X = _as_csr(X)
    n_k, d = X.shape
    ya = _as_labels(y, n_k)
    wt = _as_vector(w_t, d, "w_t")
    g = _as_vector(full_grad, d, "full_grad")
    o = _as_order(order, n_k)
    sv = np.ones(d) if s is None else _as_vector(s, d, "s")
    hk = float(h) / max(n_k, 1)
    w = wt.copy()
    for i in o:
        row = X.getrow(int(i))
        idx, vals = row.indices, row.data
        z = float(vals @ w[idx])
        z_t = float(vals @ wt[idx])
        yi = ya[i]
        gi = -yi / (1.0 + math.exp(yi * z)) + yi / (1.0 + math.exp(yi * z_t))
        w_new = w - hk * (lam * (w - wt) + g)
        np.add.at(w_new, idx, -hk * gi * sv[idx] * vals)
        w = w_new
    return w


def fsvrg_aggregate(
    w_t: Any,
    local_models: Iterable[Any],
    sizes: Iterable[int],
    a: Any,
    *,
    n: int | None = None,
) -> np.ndarray:
    """Server-side FSVRG aggregation (Algorithm 4, line 11).

    ``w_{t+1} = w_t + A sum_k (n_k/n) (w_k - w_t)``. Both iterables are consumed in step (a
    generator works: only ``O(d)`` is held).

    Parameters
    ----------
    w_t : ndarray (d,)
    local_models : iterable of ndarray (d,)
        The nodes' ``w_k``.
    sizes : iterable of int
        Their ``n_k``, in the same order.
    a : ndarray (d,)
        The diagonal of ``A`` (:attr:`FeatureStats.a`).
    n : int, optional
        The ``n`` of ``n_k/n``. Default: the sum of ``sizes`` (equal to the paper's ``n``
        when every node replies). Pass :attr:`FeatureStats.n` to keep the paper's weights
        when some nodes drop (a missing node then contributes no change).
    """
    wt = np.asarray(w_t, dtype=np.float64).reshape(-1)
    d = wt.shape[0]
    av = _as_vector(a, d, "a")
    acc = np.zeros(d)
    total = 0
    for w_k, n_k in zip(local_models, sizes, strict=True):
        n_k = int(n_k)
        if n_k < 0:
            raise ValueError(f"sizes must be >= 0, got {n_k}")
        acc += n_k * (_as_vector(w_k, d, "local model") - wt)
        total += n_k
    denom = total if n is None else int(n)
    if denom <= 0:
        return wt.copy()
    return wt + av * (acc / denom)


def naive_fsvrg_aggregate(w_t: Any, local_models: Iterable[Any]) -> np.ndarray:
    """Server-side naive FSVRG aggregation (Algorithm 3, line 11): ``w_t + mean(w_k - w_t)``."""
    wt = np.asarray(w_t, dtype=np.float64).reshape(-1)
    acc = np.zeros_like(wt)
    count = 0
    for w_k in local_models:
        acc += _as_vector(w_k, wt.shape[0], "local model") - wt
        count += 1
    return wt.copy() if count == 0 else wt + acc / count


def uniform_sample_order(seed: int, task_id: int, server_round: int, n: int,
                         m: int | None = None) -> np.ndarray:
    """``m`` row indices drawn uniformly with replacement (Algorithm 3; ``m`` defaults to n).

    From ``np.random.default_rng([seed, task_id, round, TAG_UNIFORM_SAMPLE])``.
    """
    m = n if m is None else int(m)
    if n < 0 or m < 0:
        raise ValueError(f"n and m must be >= 0, got {n}, {m}")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng([int(seed), int(task_id), int(server_round), TAG_UNIFORM_SAMPLE])
    return rng.integers(0, n, size=m, dtype=np.int64)


# --------------------------------------------------------------------------------------------
# DANE (Algorithm 2) with SVRG as the local solver


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
    X = _as_csr(X)
    n_k, d = X.shape
    ya = _as_labels(y, n_k)
    wt = _as_vector(w_t, d, "w_t")
    g = _as_vector(full_grad, d, "full_grad")
    lam = _positive(lam, "lam", allow_zero=True)
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


# --------------------------------------------------------------------------------------------
# CoCoA+ on the logistic dual


@kernel(inline="always")
def _sigmoid(u):  # pragma: no cover - compiled
    if u >= 0.0:
        return 1.0 / (1.0 + math.exp(-u))
    e = math.exp(u)
    return e / (1.0 + e)


@kernel()
def _logistic_coordinate(c0, q, beta0, max_newton, tol):  # pragma: no cover - compiled
    """The ``beta in (0, 1)`` maximising ``H(beta) - c0 (beta - beta0) - q/2 (beta - beta0)^2``.

    ``H`` is the binary entropy. In ``u = logit(beta)`` the optimality condition is
    ``r(u) = u + c0 + q (sigmoid(u) - beta0) = 0``, ``r' = 1 + q sigmoid'(u) >= 1``; the root
    lies in ``[-c0 - q (1 - beta0), -c0 + q beta0]``. Newton steps, kept inside the shrinking
    bracket by bisection.
    """
    lo = -c0 - q * (1.0 - beta0)
    hi = -c0 + q * beta0
    if hi - lo <= 0.0:
        return _sigmoid(lo)
    # start: one fixed-point step from u = -c0, clipped into the bracket
    u = -c0 - q * (_sigmoid(-c0) - beta0)
    if u <= lo or u >= hi:
        u = 0.5 * (lo + hi)
    for _ in range(max_newton):
        sg = _sigmoid(u)
        r = u + c0 + q * (sg - beta0)
        if abs(r) <= tol * (1.0 + abs(u)):
            break
        if r > 0.0:
            hi = u
        else:
            lo = u
        u_new = u - r / (1.0 + q * sg * (1.0 - sg))
        if not (lo < u_new < hi):
            u_new = 0.5 * (lo + hi)
        if u_new == u:
            break
        u = u_new
    return _sigmoid(u)


@kernel(boundscheck=False)
def _cocoa_kernel(indptr, indices, data, y, alpha, sqnorm, order, scale, max_newton, tol,
                  d_alpha, v):  # pragma: no cover - compiled
    for t in range(order.shape[0]):
        i = order[t]
        start = indptr[i]
        stop = indptr[i + 1]
        m = 0.0
        for p in range(start, stop):
            m += data[p] * v[indices[p]]
        yi = y[i]
        beta0 = yi * (alpha[i] + d_alpha[i])
        beta = _logistic_coordinate(yi * m, scale * sqnorm[i], beta0, max_newton, tol)
        delta = yi * (beta - beta0)
        if delta != 0.0:
            d_alpha[i] += delta
            c = scale * delta
            for p in range(start, stop):
                v[indices[p]] += c * data[p]


def cocoa_plus_local_sdca(
    X: Any,
    y: Any,
    alpha: Any,
    w: Any,
    *,
    lam: float,
    n: int,
    sigma_prime: float,
    order: Any,
    max_newton: int = 30,
    tol: float = 1e-13,
) -> tuple[np.ndarray, np.ndarray]:
    """Node-side CoCoA+ local solver: SDCA on the logistic dual subproblem.

    The dual of ``f`` is ``D(alpha) = (1/n) sum_i H(y_i alpha_i) - (lam/2)|w(alpha)|^2``,
    ``H(b) = -b log b - (1-b) log(1-b)`` (``b = y_i alpha_i in [0, 1]``),
    ``w(alpha) = (1/(lam n)) sum_i alpha_i x_i``. Node ``k`` maximises the CoCoA+ subproblem
    (Ma et al. 2015, eq. (10))::

        (1/n) sum_{i in P_k} H(y_i (alpha_i + da_i)) - (1/n) w^T X_k^T da
            - (sigma' / (2 lam n^2)) |X_k^T da|^2

    one coordinate at a time, exactly (up to ``tol``), with safeguarded Newton steps in
    ``logit(y_i alpha_i)``; the coordinate sees ``v = w + sigma' d_w``.

    Parameters
    ----------
    X : scipy sparse matrix (n_k, d)
    y : ndarray (n_k,)
        Labels in {-1, +1}.
    alpha : ndarray (n_k,)
        The node's committed dual variables, ``y * alpha`` in ``[0, 1]`` (start: zeros).
        Not modified.
    w : ndarray (d,)
        The server's ``w = w(alpha)`` (all nodes' alphas).
    lam : float
        ``lam > 0``.
    n : int
        The global number of rows ``n``.
    sigma_prime : float
        ``sigma' = gamma K``; CoCoA+ (adding, ``gamma = 1``) uses ``K``.
    order : array of int
        Coordinates visited (``coordinate_order(seed, task_id, round, n_k)`` for one pass).
    max_newton, tol
        Newton iterations per coordinate (at most) and the tolerance on the optimality
        condition.

    Returns
    -------
    d_alpha : ndarray (n_k,)
        The change of the node's dual variables (commit ``alpha += d_alpha`` when accepted).
    d_w : ndarray (d,)
        ``X_k^T d_alpha / (lam n)``, sent to the server (:func:`cocoa_plus_aggregate`).
    """
    X = _as_csr(X)
    n_k, d = X.shape
    ya = _as_labels(y, n_k)
    al = _as_vector(alpha, n_k, "alpha")
    b = ya * al
    if np.any(b < -1e-12) or np.any(b > 1.0 + 1e-12):
        raise ValueError("alpha must satisfy 0 <= y * alpha <= 1")
    wa = _as_vector(w, d, "w")
    lam = _positive(lam, "lam")
    sigma_prime = _positive(sigma_prime, "sigma_prime")
    if int(n) < max(n_k, 1):
        raise ValueError(f"n must be >= n_k = {n_k} (the global row count), got {n}")
    o = _as_order(order, n_k)
    d_alpha = np.zeros(n_k)
    if n_k == 0 or o.size == 0:
        return d_alpha, np.zeros(d)
    sqnorm = np.asarray(X.multiply(X).sum(axis=1), dtype=np.float64).reshape(-1)
    scale = sigma_prime / (lam * int(n))
    v = wa.copy()
    data = np.ascontiguousarray(X.data, dtype=np.float64)
    _cocoa_kernel(X.indptr, X.indices, data, ya, al, sqnorm, o, scale, int(max_newton),
                  float(tol), d_alpha, v)
    d_w = np.asarray(X.T @ d_alpha, dtype=np.float64).reshape(-1) / (lam * int(n))
    return d_alpha, d_w


def cocoa_plus_aggregate(w: Any, d_w_sum: Any, gamma: float = 1.0) -> np.ndarray:
    """Server-side CoCoA+ update ``w + gamma * sum_k d_w_k`` (CoCoA+: ``gamma = 1``)."""
    wa = np.asarray(w, dtype=np.float64).reshape(-1)
    return wa + float(gamma) * _as_vector(d_w_sum, wa.shape[0], "d_w_sum")


def primal_from_dual(X: Any, alpha: Any, lam: float, n: int) -> np.ndarray:
    """A node's share ``X_k^T alpha_k / (lam n)`` of ``w(alpha)`` (sum over nodes)."""
    X = _as_csr(X)
    al = _as_vector(alpha, X.shape[0], "alpha")
    return np.asarray(X.T @ al, dtype=np.float64).reshape(-1) / (float(lam) * int(n))


def logistic_dual_sum(y: Any, alpha: Any) -> float:
    """Node-side ``sum_i H(y_i alpha_i)`` (binary entropy, ``0 log 0 = 0``) for the dual."""
    ya = np.asarray(y, dtype=np.float64).reshape(-1)
    b = np.clip(ya * np.asarray(alpha, dtype=np.float64).reshape(-1), 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -(np.where(b > 0, b * np.log(b), 0.0) + np.where(b < 1, (1 - b) * np.log1p(-b), 0.0))
    return float(np.sum(ent))


def dual_objective(w: Any, dual_sum: float, n: int, lam: float) -> float:
    """Server-side ``D(alpha) = dual_sum / n - (lam/2)|w|^2``, with ``w = w(alpha)``.

    ``global_objective(w, loss_sum, n, lam) - dual_objective(w, dual_sum, n, lam)`` is the
    duality gap (``>= 0``; 0 exactly at the optimum).
    """
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    wa = np.asarray(w, dtype=np.float64).reshape(-1)
    return float(dual_sum) / n - 0.5 * float(lam) * float(wa @ wa)
