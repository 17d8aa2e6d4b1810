"""FSVRG, naive FSVRG, GD, CoCoA+ and DANE numerics (core/fsvrg.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.optimize import minimize, minimize_scalar
from scipy.sparse.linalg import svds
from sklearn.linear_model import LogisticRegression

from fmtl_flower.core import fsvrg as F
from fmtl_flower.core.rng import coordinate_order
from fmtl_flower.data.sparse_federated import make_sparse_federated

# --------------------------------------------------------------------------------------------
# helpers


def random_csr(n, d, density, rng, *, empty_row=False, scale=1.0):
    X = sp.random(n, d, density=density, random_state=rng, format="csr",
                  data_rvs=lambda k: rng.normal(size=k) * scale)
    if empty_row and n > 1:
        X = X.tolil()
        X[int(rng.integers(n)), :] = 0
        X = X.tocsr()
        X.eliminate_zeros()
    return X


def dense_loss_grad(Xd, y, w, lam):
    """The objective and gradient written out densely (independent of the module)."""
    z = y * (Xd @ w)
    loss = np.where(z > 0, np.log1p(np.exp(-np.abs(z))), -z + np.log1p(np.exp(-np.abs(z))))
    sig = 1.0 / (1.0 + np.exp(z))  # sigmoid(-z)
    n = Xd.shape[0]
    return loss.mean() + 0.5 * lam * w @ w, -(Xd.T @ (y * sig)) / n + lam * w


def dense_pass(Xd, y, w_t, g, lam, step, s, order):
    """The FSVRG update rule written out densely, one row at a time."""
    w = w_t.copy()
    s = np.ones(Xd.shape[1]) if s is None else s
    for i in order:
        x = Xd[i]
        d_now = -y[i] / (1.0 + np.exp(y[i] * (x @ w)))
        d_t = -y[i] / (1.0 + np.exp(y[i] * (x @ w_t)))
        w = w - step * (s * (d_now - d_t) * x + lam * (w - w_t) + g)
    return w


def sklearn_optimum(X, y, lam):
    n = X.shape[0]
    clf = LogisticRegression(fit_intercept=False, C=1.0 / (lam * n), tol=1e-12, max_iter=20000)
    clf.fit(X, y)
    return clf.coef_.ravel()


@pytest.fixture(scope="module")
def federation():
    """A small non-IID federation (40 nodes, d = 2000, node sizes 30..600) and lam = 1e-3."""
    ds = make_sparse_federated(40, dim=2000, seed=0, size_max=800)
    X, y = ds.pooled_train()
    lam = 1e-3
    w_star = sklearn_optimum(X, y, lam)
    return ds, X, y, lam, w_star, F.logistic_objective(X, y, w_star, lam)


# --------------------------------------------------------------------------------------------
# statistics


def tiny_nodes():
    """Three nodes, d = 4; node 0 stores an explicit zero, node 1 a duplicate entry."""
    X0 = sp.csr_matrix((np.array([1.0, 2.0, 0.0, 3.0]), np.array([0, 2, 3, 2]),
                        np.array([0, 3, 4])), shape=(2, 4))  # (0,3) is an explicit zero
    X1 = sp.csr_matrix((np.array([1.0, 0.5, 0.5, 1.0]), np.array([0, 0, 0, 2]),
                        np.array([0, 1, 3, 4])), shape=(3, 4))  # row 1: feature 0 twice
    X2 = sp.csr_matrix(np.array([[4.0, 0.0, 0.0, 5.0]]))
    return [X0, X1, X2]


def test_statistics_exact_on_tiny_nodes():
    nodes = tiny_nodes()
    counts = [F.node_feature_counts(X) for X in nodes]
    assert [c[0] for c in counts] == [2, 3, 1]
    np.testing.assert_array_equal(counts[0][1], [1, 0, 2, 0])
    np.testing.assert_array_equal(counts[1][1], [2, 0, 1, 0])
    np.testing.assert_array_equal(counts[2][1], [1, 0, 0, 1])
    assert counts[0][1].dtype == np.int64
    st = F.combine_feature_counts(counts)
    assert (st.num_nodes, st.n, st.dim) == (3, 6, 4)
    np.testing.assert_array_equal(st.n_j, [4, 0, 3, 1])
    np.testing.assert_array_equal(st.omega, [3, 0, 2, 1])
    np.testing.assert_allclose(st.phi, [4 / 6, 0, 3 / 6, 1 / 6], rtol=1e-15)
    # a^j = K / omega^j; 1 where no node has the feature; K for a single-node feature
    np.testing.assert_allclose(st.a, [1.0, 1.0, 1.5, 3.0], rtol=1e-15)
    # s_k^j = phi^j / phi_k^j, 1 where n_k^j = 0
    expected_s = [[4 / 3, 1, 1 / 2, 1], [1, 1, 3 / 2, 1], [2 / 3, 1, 1, 1 / 6]]
    for (n_k, c), s_exp in zip(counts, expected_s, strict=True):
        np.testing.assert_allclose(st.node_scaling(n_k, c), s_exp, rtol=1e-15)
        np.testing.assert_allclose(F.node_scaling(st.phi, n_k, c), s_exp, rtol=1e-15)


def test_feature_on_one_node_gets_a_equal_K():
    rng = np.random.default_rng(3)
    K, d = 7, 12
    nodes = [random_csr(int(rng.integers(3, 9)), d, 0.4, rng) for _ in range(K)]
    for k, X in enumerate(nodes):  # feature d-1 only on node 4
        X = X.tolil()
        X[:, d - 1] = 0.0
        if k == 4:
            X[0, d - 1] = 2.5
        nodes[k] = X.tocsr()
    st = F.combine_feature_counts(F.node_feature_counts(X) for X in nodes)
    assert st.omega[d - 1] == 1
    assert st.a[d - 1] == K
    # s on that node is phi / phi_k = (1/n) / (1/n_4) = n_4 / n
    n_4, c_4 = F.node_feature_counts(nodes[4])
    assert st.node_scaling(n_4, c_4)[d - 1] == pytest.approx(n_4 / st.n, rel=1e-15)


def test_accumulator_streams_and_validates():
    counts = [F.node_feature_counts(X) for X in tiny_nodes()]
    acc = F.FeatureCountAccumulator(4)
    for n_k, c in counts:
        acc.add(n_k, c)
    st = acc.result()
    ref = F.combine_feature_counts(counts)
    np.testing.assert_array_equal(st.n_j, ref.n_j)
    np.testing.assert_array_equal(st.omega, ref.omega)
    with pytest.raises(ValueError, match="shape"):
        acc.add(2, np.zeros(5, dtype=np.int64))
    with pytest.raises(ValueError, match="n_k"):
        acc.add(2, np.array([3, 0, 0, 0]))
    with pytest.raises(ValueError, match="integers"):
        acc.add(2, np.array([0.5, 0, 0, 0]))
    with pytest.raises(ValueError, match="no data"):
        F.FeatureCountAccumulator(3).result()
    with pytest.raises(ValueError, match="no node"):
        F.combine_feature_counts([])


# --------------------------------------------------------------------------------------------
# objective and gradients


def test_loss_grad_match_dense_and_finite_differences():
    rng = np.random.default_rng(0)
    X = random_csr(40, 9, 0.4, rng, empty_row=True)
    y = rng.choice([-1.0, 1.0], size=40)
    w = rng.normal(size=9)
    lam = 0.03
    f, g = F.logistic_loss_grad(X, y, w, lam)
    f_d, g_d = dense_loss_grad(X.toarray(), y, w, lam)
    assert f == pytest.approx(f_d, rel=1e-13)
    np.testing.assert_allclose(g, g_d, rtol=1e-12, atol=1e-15)
    eps = 1e-6
    fd = np.array([(F.logistic_objective(X, y, w + eps * e, lam)
                    - F.logistic_objective(X, y, w - eps * e, lam)) / (2 * eps)
                   for e in np.eye(9)])
    np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-9)


def test_loss_is_stable_for_huge_margins():
    X = sp.csr_matrix(np.array([[1.0], [1.0]]))
    y = np.array([1.0, -1.0])
    w = np.array([800.0])  # margins +800 and -800: exp would overflow
    f, g = F.logistic_loss_grad(X, y, w, 0.0)
    assert f == pytest.approx(400.0, rel=1e-15)  # (0 + 800) / 2
    assert g[0] == pytest.approx(0.5, rel=1e-15)  # (0 + 1) / 2
    loss, grad = F.local_loss_grad_sums(X, y, -w)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))


def test_node_sums_combine_into_the_global_objective():
    rng = np.random.default_rng(1)
    nodes = [random_csr(int(rng.integers(1, 20)), 6, 0.5, rng) for _ in range(5)]
    labels = [rng.choice([-1.0, 1.0], size=X.shape[0]) for X in nodes]
    w = rng.normal(size=6)
    lam = 0.1
    sums = [F.local_loss_grad_sums(X, y, w) for X, y in zip(nodes, labels, strict=True)]
    n = sum(X.shape[0] for X in nodes)
    f = F.global_objective(w, sum(s[0] for s in sums), n, lam)
    g = F.global_gradient(w, sum(s[1] for s in sums), n, lam)
    f_c, g_c = F.logistic_loss_grad(sp.vstack(nodes), np.concatenate(labels), w, lam)
    assert f == pytest.approx(f_c, rel=1e-14)
    np.testing.assert_allclose(g, g_c, rtol=1e-13, atol=1e-16)


def test_sklearn_normalisation_matches_our_objective(federation):
    ds, X, y, lam, w_star, f_star = federation
    _, g = F.logistic_loss_grad(X, y, w_star, lam)
    assert np.linalg.norm(g) < 1e-6  # sklearn's C = 1/(lam n) minimises our f
    rng = np.random.default_rng(0)
    for _ in range(3):
        assert F.logistic_objective(X, y, w_star + 1e-3 * rng.normal(size=X.shape[1]),
                                    lam) > f_star


# --------------------------------------------------------------------------------------------
# the local passes


@pytest.mark.parametrize("case", range(6))
def test_numba_pass_matches_scipy_row_reference(case):
    rng = np.random.default_rng(100 + case)
    n, d = int(rng.integers(1, 60)), int(rng.integers(1, 40))
    X = random_csr(n, d, [0.05, 0.2, 0.6][case % 3], rng, empty_row=case % 2 == 0,
                   scale=[0.3, 1.0, 3.0][case % 3])
    y = rng.choice([-1.0, 1.0], size=n)
    w_t = rng.normal(size=d) * 0.5
    g = rng.normal(size=d) * 0.1
    s = rng.uniform(0.1, 5.0, size=d)
    lam = [0.0, 1e-3, 0.5][case % 3]
    h = [0.3, 1.0, 4.0][case // 2]
    order = coordinate_order(case, 3, 7, n)
    fast = F.fsvrg_local_pass(X, y, w_t, g, lam=lam, h=h, s=s, order=order)
    ref = F.fsvrg_local_pass_reference(X, y, w_t, g, lam=lam, h=h, s=s, order=order)
    dense = dense_pass(X.toarray(), y, w_t, g, lam, h / n, s, order)
    np.testing.assert_allclose(fast, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ref, dense, rtol=1e-12, atol=1e-12)
    # S_k = I, and the naive pass is the same update with the step h itself
    fast_i = F.fsvrg_local_pass(X, y, w_t, g, lam=lam, h=h, s=None, order=order)
    np.testing.assert_allclose(
        fast_i, F.fsvrg_local_pass_reference(X, y, w_t, g, lam=lam, h=h, s=None, order=order),
        rtol=1e-12, atol=1e-12)
    naive = F.naive_fsvrg_local_pass(X, y, w_t, g, lam=lam, h=h / n, order=order)
    np.testing.assert_allclose(naive, fast_i, rtol=1e-12, atol=1e-12)


def _numpy_and_compiled(run):
    from fmtl_flower.core import jit

    with jit.using("numba"):
        compiled = run()
    with jit.using("numpy"):
        plain = run()
    return compiled, plain


@pytest.mark.skipif(not __import__("fmtl_flower.core.jit").core.jit.numba_available(),
                    reason="numba is not installed")
@pytest.mark.parametrize("case", range(8))
def test_numpy_fsvrg_family_kernels_equal_compiled(case):
    """The numpy FSVRG pass (FSVRG, naive FSVRG, DANE's epochs) and CoCoA+ SDCA equal the
    compiled kernels to 1e-12 relative (not bit for bit: numpy's row dot products sum in
    another order): empty rows, a duplicate entry (non-canonical CSR), an underflowing
    implicit scale (step * lam = 0.9) and repeated samples included."""
    rng = np.random.default_rng(300 + case)
    n, d = int(rng.integers(2, 50)), int(rng.integers(1, 30))
    X = random_csr(n, d, [0.05, 0.3, 0.8][case % 3], rng, empty_row=case % 2 == 0,
                   scale=[0.3, 1.0, 3.0][case % 3])
    if case == 3:  # a duplicated entry in row 0 (scipy keeps it; the kernels add both)
        X = sp.csr_matrix((np.r_[1.5, 0.5, X.data], np.r_[0, 0, X.indices],
                           np.r_[0, X.indptr + 2]), shape=(n + 1, d))
        n += 1
    assert X.nnz
    y = rng.choice([-1.0, 1.0], size=n)
    w_t, g = rng.normal(size=d) * 0.5, rng.normal(size=d) * 0.1
    s = rng.uniform(0.1, 5.0, size=d)
    lam = [1e-3, 0.5, 0.0, 0.9][case % 4]
    order = coordinate_order(case, 3, 7, n)
    repeated = F.uniform_sample_order(case, 2, 3, n, 4 * n)
    alpha = y * rng.uniform(0, 1, size=n) * (case % 2)

    def run():
        return [F.fsvrg_local_pass(X, y, w_t, g, lam=lam, h=0.3 * n, s=s, order=order),
                F.fsvrg_local_pass(X, y, w_t, g, lam=lam, h=0.3 * n, s=None, order=order),
                F.naive_fsvrg_local_pass(X, y, w_t, g, lam=lam, h=1.0, order=repeated),
                F.dane_local_solve(X, y, w_t, g, lam=lam + 0.01, step=0.2,
                                   orders=F.dane_epoch_orders(case, 1, 2, n, 3)),
                *F.cocoa_plus_local_sdca(X, y, alpha, w_t, lam=lam + 0.01, n=2 * n,
                                         sigma_prime=2.0, order=repeated)]

    compiled, plain = _numpy_and_compiled(run)
    for a, b in zip(compiled, plain, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-14)


def test_pass_with_underflowing_scale_and_repeated_samples():
    # step * lam = 0.9: the implicit scale alpha = 0.1^t underflows and is renormalised
    rng = np.random.default_rng(5)
    n, d = 15, 8
    X = random_csr(n, d, 0.4, rng)
    y = rng.choice([-1.0, 1.0], size=n)
    w_t, g = rng.normal(size=d), rng.normal(size=d) * 0.1
    order = F.uniform_sample_order(1, 2, 3, n, 400)
    fast = F.naive_fsvrg_local_pass(X, y, w_t, g, lam=0.9, h=1.0, order=order)
    ref = dense_pass(X.toarray(), y, w_t, g, 0.9, 1.0, None, order)
    np.testing.assert_allclose(fast, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="< 1"):
        F.naive_fsvrg_local_pass(X, y, w_t, g, lam=1.0, h=1.0, order=order)


def test_pass_stays_at_the_optimum(federation):
    # property (A): grad f(w*) = 0, so every node's pass returns w* (to the solver tolerance)
    ds, X, y, lam, w_star, _ = federation
    g = F.logistic_loss_grad(X, y, w_star, lam)[1]
    st = F.combine_feature_counts(F.node_feature_counts(t.X_train) for t in ds.tasks)
    for k in (0, 7):
        t = ds.task(k)
        s = st.node_scaling(*F.node_feature_counts(t.X_train))
        w_k = F.fsvrg_local_pass(t.X_train, t.y_train, w_star, g, lam=lam, h=8.0, s=s,
                                 order=coordinate_order(0, k, 1, t.n_train))
        assert np.max(np.abs(w_k - w_star)) < 1e-6  # |grad f(w*)| ~ 5e-8 from sklearn


def test_pass_validates_inputs():
    X = sp.csr_matrix(np.eye(3))
    w = np.zeros(3)
    with pytest.raises(ValueError, match="-1, \\+1"):
        F.fsvrg_local_pass(X, np.array([1.0, 0.0, 1.0]), w, w, lam=0.1, h=1.0, s=None,
                           order=[0, 1, 2])
    with pytest.raises(ValueError, match="rows 0..2"):
        F.fsvrg_local_pass(X, np.ones(3), w, w, lam=0.1, h=1.0, s=None, order=[0, 3])
    with pytest.raises(ValueError, match="length 3"):
        F.fsvrg_local_pass(X, np.ones(3), w, np.zeros(2), lam=0.1, h=1.0, s=None, order=[0])
    with pytest.raises(ValueError, match="h must be"):
        F.fsvrg_local_pass(X, np.ones(3), w, w, lam=0.1, h=0.0, s=None, order=[0])
    # an empty order or an empty node returns w_t
    out = F.fsvrg_local_pass(X, np.ones(3), np.ones(3), w, lam=0.1, h=1.0, s=None, order=[])
    np.testing.assert_array_equal(out, np.ones(3))


# --------------------------------------------------------------------------------------------
# aggregation


def test_fsvrg_aggregate_exact():
    w_t = np.array([1.0, 2.0, 3.0])
    models = [np.array([2.0, 2.0, 3.0]), np.array([1.0, 5.0, 0.0])]
    sizes = [1, 3]
    a = np.array([1.0, 2.0, 0.5])
    # w + A sum_k (n_k / n)(w_k - w): n = 4
    expected = w_t + a * (0.25 * np.array([1.0, 0.0, 0.0]) + 0.75 * np.array([0.0, 3.0, -3.0]))
    np.testing.assert_allclose(F.fsvrg_aggregate(w_t, models, sizes, a), expected, rtol=1e-15)
    np.testing.assert_allclose(F.fsvrg_aggregate(w_t, iter(models), iter(sizes), a), expected,
                               rtol=1e-15)
    # the paper's n (a node that dropped counts in n but contributes no change)
    with_n = F.fsvrg_aggregate(w_t, models, sizes, a, n=8)
    np.testing.assert_allclose(with_n - w_t, (expected - w_t) / 2, rtol=1e-15)
    np.testing.assert_allclose(F.naive_fsvrg_aggregate(w_t, models), [1.5, 3.5, 1.5])
    np.testing.assert_allclose(F.dane_aggregate(models), [1.5, 3.5, 1.5])
    np.testing.assert_allclose(F.cocoa_plus_aggregate(w_t, [1.0, 1.0, 1.0], gamma=0.5),
                               [1.5, 2.5, 3.5])
    with pytest.raises(ValueError):
        F.fsvrg_aggregate(w_t, models, [1], a)


# --------------------------------------------------------------------------------------------
# federated runs against the independent optimum


def run_fsvrg(ds, lam, h, rounds, *, naive=False, seed=0):
    d = ds.dim
    st = F.combine_feature_counts(F.node_feature_counts(t.X_train) for t in ds.tasks)
    scalings = [st.node_scaling(*F.node_feature_counts(t.X_train)) for t in ds.tasks]
    w = np.zeros(d)
    values = []
    for r in range(rounds + 1):
        sums = [F.local_loss_grad_sums(t.X_train, t.y_train, w) for t in ds.tasks]
        values.append(F.global_objective(w, sum(s[0] for s in sums), st.n, lam))
        if r == rounds:
            break
        g = F.global_gradient(w, sum(s[1] for s in sums), st.n, lam)
        if naive:
            models = (F.naive_fsvrg_local_pass(
                t.X_train, t.y_train, w, g, lam=lam, h=h,
                order=F.uniform_sample_order(seed, k, r, t.n_train))
                for k, t in enumerate(ds.tasks))
            w = F.naive_fsvrg_aggregate(w, models)
        else:
            models = (F.fsvrg_local_pass(
                t.X_train, t.y_train, w, g, lam=lam, h=h, s=scalings[k],
                order=coordinate_order(seed, k, r, t.n_train)) for k, t in enumerate(ds.tasks))
            w = F.fsvrg_aggregate(w, models, ds.n_train, st.a, n=st.n)
    return w, np.array(values)


def test_fsvrg_reaches_the_sklearn_optimum(federation):
    ds, _, _, lam, _, f_star = federation
    _, values = run_fsvrg(ds, lam, h=16.0, rounds=30)
    rel = (values - f_star) / f_star
    assert rel.min() > -1e-9  # nothing beats the optimum
    assert rel[0] > 0.3
    assert rel[-1] < 1e-3  # measured: 1.2e-4 after 30 rounds
    assert np.all(np.diff(rel[1:]) < 0)


def test_naive_fsvrg_makes_progress(federation):
    ds, _, _, lam, _, f_star = federation
    _, values = run_fsvrg(ds, lam, h=0.02, rounds=10, naive=True)
    assert values[-1] < values[0] and values[-1] > f_star


def test_local_gram_products_sum_to_the_pooled_gram_operator(federation):
    ds, X, _, _, _, _ = federation
    rng = np.random.default_rng(1)
    v = rng.normal(size=X.shape[1])
    u = sum(F.local_gram_product(t.X_train, v) for t in ds.tasks)
    Xd = X.toarray()
    np.testing.assert_allclose(u, Xd.T @ (Xd @ v), rtol=1e-10, atol=1e-10 * np.abs(u).max())
    with pytest.raises(ValueError, match="v"):
        F.local_gram_product(X, np.ones(X.shape[1] + 1))


def test_power_estimates_are_increasing_lower_bounds_of_sigma_max_squared(federation):
    """Each estimate |u|^2 / (v . u) <= sigma_max(X)^2, never decreasing, and within
    GD_POWER_TOL of it when the stopping rule fires (here, and on the 40-node federation)."""
    ds, X, _, lam, _, _ = federation
    top = float(svds(X, k=1, return_singular_vectors=False)[0]) ** 2
    v = F.gram_power_start(0, X.shape[1])
    assert np.isclose(np.linalg.norm(v), 1.0)
    np.testing.assert_array_equal(v, F.gram_power_start(0, X.shape[1]))
    estimates, stopped = [], None
    for _ in range(F.GD_POWER_MAX_ITER):
        u = sum(F.local_gram_product(t.X_train, v) for t in ds.tasks)
        rayleigh = float(v @ u)
        estimate, v = F.power_estimate(v, u)
        assert rayleigh <= estimate * (1 + 1e-12) and estimate <= top * (1 + 1e-12)
        if stopped is None and estimates and estimate <= estimates[-1] * (1 + F.GD_POWER_TOL):
            stopped = estimate
        estimates.append(estimate)
    assert np.all(np.diff(estimates) >= -1e-12 * top)
    assert stopped is not None and stopped >= top * (1 - F.GD_POWER_TOL)
    L = F.gd_smoothness(estimates[-1], X.shape[0], lam)
    assert L == pytest.approx(top / (4 * X.shape[0]) + lam, rel=1e-6)
    zero, same = F.power_estimate(v, np.zeros_like(v))
    assert zero == 0.0 and same is not None and np.array_equal(same, v)


def test_gd_rounds_decrease_the_objective(federation):
    ds, X, y, lam, _, f_star = federation
    L = svds(X, k=1, return_singular_vectors=False)[0] ** 2 / (4 * X.shape[0]) + lam
    w = np.zeros(X.shape[1])
    values = []
    for _ in range(20):
        sums = [F.local_loss_grad_sums(t.X_train, t.y_train, w) for t in ds.tasks]
        values.append(F.global_objective(w, sum(s[0] for s in sums), X.shape[0], lam))
        w = F.gd_step(w, F.global_gradient(w, sum(s[1] for s in sums), X.shape[0], lam), 1 / L)
    assert np.all(np.diff(values) < 0)
    assert values[-1] > f_star


def test_cocoa_plus_gap_nonnegative_and_shrinking(federation):
    ds, X, y, lam, _, f_star = federation
    K, n = ds.num_tasks, int(ds.n_train.sum())
    alphas = [np.zeros(t.n_train) for t in ds.tasks]
    w = np.zeros(ds.dim)
    gaps, duals = [], []
    for r in range(12):
        loss = sum(F.local_loss_grad_sums(t.X_train, t.y_train, w)[0] for t in ds.tasks)
        dual = sum(F.logistic_dual_sum(t.y_train, a) for t, a in zip(ds.tasks, alphas,
                                                                   strict=True))
        primal_value = F.global_objective(w, loss, n, lam)
        dual_value = F.dual_objective(w, dual, n, lam)
        gaps.append(primal_value - dual_value)
        duals.append(dual_value)
        assert dual_value <= f_star + 1e-12 <= primal_value + 2e-12  # weak duality
        d_w_sum = np.zeros(ds.dim)
        for k, t in enumerate(ds.tasks):
            d_alpha, d_w = F.cocoa_plus_local_sdca(
                t.X_train, t.y_train, alphas[k], w, lam=lam, n=n, sigma_prime=K,
                order=coordinate_order(0, k, r, t.n_train))
            alphas[k] = alphas[k] + d_alpha
            d_w_sum += d_w
        w = F.cocoa_plus_aggregate(w, d_w_sum)
        # w stays w(alpha)
        w_alpha = sum(F.primal_from_dual(t.X_train, a, lam, n) for t, a in zip(ds.tasks, alphas,
                                                                             strict=True))
        np.testing.assert_allclose(w, w_alpha, rtol=1e-10, atol=1e-12)
        assert all(np.all((t.y_train * a >= 0) & (t.y_train * a <= 1))
                   for t, a in zip(ds.tasks, alphas, strict=True))
    gaps = np.array(gaps)
    assert np.all(gaps >= -1e-12)
    # sigma' = K makes every round a safe dual ascent step; the primal need not be monotone
    assert np.all(np.diff(duals) > 0)
    assert gaps[-1] < 0.75 * gaps[0]  # measured: 0.693 -> 0.496 (CoCoA+ is slow here)


def test_cocoa_coordinate_step_is_the_exact_maximiser():
    rng = np.random.default_rng(9)
    for trial in range(40):
        d = 5
        x = rng.normal(size=d) * rng.choice([0.1, 1.0, 10.0])
        X = sp.csr_matrix(x[None, :])
        y = np.array([rng.choice([-1.0, 1.0])])
        beta0 = [0.0, 1.0, rng.uniform()][trial % 3]
        alpha = y * beta0
        w = rng.normal(size=d) * rng.choice([0.1, 1.0, 10.0])
        lam, n, sp_ = 10 ** rng.uniform(-4, 0), int(rng.integers(1, 50)), float(rng.integers(1, 9))
        d_alpha, d_w = F.cocoa_plus_local_sdca(X, y, alpha, w, lam=lam, n=n, sigma_prime=sp_,
                                               order=[0])
        m, q = y[0] * (x @ w), sp_ * (x @ x) / (lam * n)

        def neg(b, m=m, q=q, beta0=beta0):
            ent = -(b * math.log(b) if b > 0 else 0.0) - ((1 - b) * math.log1p(-b) if b < 1
                                                          else 0.0)
            return -(ent - m * (b - beta0) - 0.5 * q * (b - beta0) ** 2)

        beta = y[0] * (alpha[0] + d_alpha[0])
        best = minimize_scalar(neg, bounds=(0.0, 1.0), method="bounded",
                               options={"xatol": 1e-13})
        assert 0.0 <= beta <= 1.0
        assert neg(beta) <= best.fun + 1e-10
        np.testing.assert_allclose(d_w, x * d_alpha[0] / (lam * n), rtol=1e-13)


# --------------------------------------------------------------------------------------------
# DANE


def test_dane_one_epoch_is_naive_fsvrg(federation):
    # Proposition 1: DANE (eta = 1, mu = 0) with one SVRG epoch from w_t = naive FSVRG
    ds, X, y, lam, _, _ = federation
    rng = np.random.default_rng(2)
    w_t = rng.normal(size=ds.dim) * 0.1
    g = F.logistic_loss_grad(X, y, w_t, lam)[1]
    t = ds.task(3)
    orders = F.dane_epoch_orders(4, 3, 2, t.n_train, 1)
    np.testing.assert_array_equal(orders[0], coordinate_order(4, 3, 2, t.n_train))
    dane = F.dane_local_solve(t.X_train, t.y_train, w_t, g, lam=lam, step=0.05, orders=orders)
    naive = F.naive_fsvrg_local_pass(t.X_train, t.y_train, w_t, g, lam=lam, h=0.05,
                                     order=orders[0])
    np.testing.assert_array_equal(dane, naive)


def test_dane_epochs_solve_the_local_subproblem(federation):
    ds, X, y, lam, _, _ = federation
    t = ds.task(5)
    rng = np.random.default_rng(4)
    w_t = rng.normal(size=ds.dim) * 0.05
    g = F.logistic_loss_grad(X, y, w_t, lam)[1]
    eta, mu = 1.0, 0.05
    _, gk = F.local_loss_grad_sums(t.X_train, t.y_train, w_t)
    shift = eta * g - (gk / t.n_train + lam * w_t)

    def psi(w):
        loss, gs = F.local_loss_grad_sums(t.X_train, t.y_train, w)
        value = loss / t.n_train + 0.5 * lam * w @ w + shift @ w + 0.5 * mu * np.sum((w - w_t) ** 2)
        return value, gs / t.n_train + lam * w + shift + mu * (w - w_t)

    best = minimize(psi, w_t, jac=True, method="L-BFGS-B", options={"gtol": 1e-12,
                                                                     "maxiter": 5000})
    orders = F.dane_epoch_orders(0, 5, 1, t.n_train, 40)
    w1 = F.dane_local_solve(t.X_train, t.y_train, w_t, g, lam=lam, orders=orders[:1], eta=eta,
                            mu=mu, step=None)
    w40 = F.dane_local_solve(t.X_train, t.y_train, w_t, g, lam=lam, orders=orders, eta=eta,
                             mu=mu, step=None)
    gap0, gap1, gap40 = (psi(w)[0] - best.fun for w in (w_t, w1, w40))
    assert gap0 > gap1 > gap40 >= -1e-12
    assert gap40 < 1e-3 * gap0


def test_local_error_count():
    X = sp.csr_matrix(np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]))
    y = np.array([1.0, 1.0, -1.0, -1.0])
    # margins 2, -1, 1, 0 -> predictions +1, -1, +1, -1 (sign(0) = -1)
    assert F.local_error_count(X, y, np.array([2.0, -1.0])) == (2, 4)
    assert F.relative_suboptimality(1.1, 1.0) == pytest.approx(0.1)


def test_orders_are_seeded():
    a = F.uniform_sample_order(1, 2, 3, 50, 70)
    assert a.shape == (70,) and a.min() >= 0 and a.max() < 50
    np.testing.assert_array_equal(a, F.uniform_sample_order(1, 2, 3, 50, 70))
    assert not np.array_equal(a, F.uniform_sample_order(1, 2, 4, 50, 70))
    orders = F.dane_epoch_orders(1, 2, 3, 30, 3)
    assert len(orders) == 3 and all(np.array_equal(np.sort(o), np.arange(30)) for o in orders)
    assert not np.array_equal(orders[1], orders[2])
    assert F.uniform_sample_order(0, 0, 0, 0).shape == (0,)
