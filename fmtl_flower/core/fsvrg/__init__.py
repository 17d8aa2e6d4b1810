"""FSVRG and its baselines on sparse L2-regularised logistic regression (numerics only).

Konečný, McMahan, Ramage, Richtárik, "Federated Optimization: Distributed Machine Learning for
On-Device Intelligence" (2016): Algorithm 4 (FSVRG), Algorithm 3 (naive FSVRG), Algorithm 2
(DANE), and the paper's baselines distributed gradient descent and CoCoA+. This package never
imports ``flwr``; the Flower strategy/client pair calls the functions re-exported here and
moves the named quantities over the wire. One module per method: :mod:`.logistic` (the
problem: checks, loss and gradient sums, evaluation), :mod:`.sparsity` (section 3.6.1's
statistics), :mod:`.svrg` (FSVRG and naive FSVRG), :mod:`.dane`, :mod:`.gd` (GD and its 1/L
step), :mod:`.cocoa_plus`.

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

from fmtl_flower.core.rng import TAG_DANE_EPOCH, TAG_GD_POWER, TAG_UNIFORM_SAMPLE

from .cocoa_plus import (
    clip_dual_step,
    cocoa_plus_aggregate,
    cocoa_plus_local_sdca,
    dual_objective,
    logistic_dual_sum,
    primal_from_dual,
)
from .dane import (
    dane_aggregate,
    dane_epoch_orders,
    dane_local_solve,
    default_dane_step,
)
from .gd import (
    GD_POWER_MAX_ITER,
    GD_POWER_TOL,
    gd_smoothness,
    gd_step,
    gram_power_start,
    local_gram_product,
    power_estimate,
)
from .logistic import (
    global_gradient,
    global_objective,
    local_error_count,
    local_loss_grad_sums,
    logistic_loss_grad,
    logistic_objective,
    relative_suboptimality,
)
from .sparsity import (
    FeatureCountAccumulator,
    FeatureStats,
    aggregation_weights,
    combine_feature_counts,
    node_feature_counts,
    node_scaling,
)
from .svrg import (
    fsvrg_aggregate,
    fsvrg_local_pass,
    fsvrg_local_pass_reference,
    naive_fsvrg_aggregate,
    naive_fsvrg_local_pass,
    uniform_sample_order,
)

__all__ = [
    "FeatureCountAccumulator",
    "FeatureStats",
    "GD_POWER_MAX_ITER",
    "GD_POWER_TOL",
    "TAG_DANE_EPOCH",
    "TAG_GD_POWER",
    "TAG_UNIFORM_SAMPLE",
    "aggregation_weights",
    "clip_dual_step",
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
    "global_gradient",
    "global_objective",
    "gram_power_start",
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
