"""OFMTL numerics: the newcomer's subproblem, its SDCA, the Sigma extension and the Omega-step."""

import numpy as np
import pytest
import scipy.optimize
from hypothesis import given, settings
from hypothesis import strategies as st

from fmtl_flower.core.formulations import make_formulation
from fmtl_flower.core.hinge import mean_hinge_loss
from fmtl_flower.core.ofmtl import (
    extend_sigma,
    newcomer_dual,
    newcomer_duality_gap,
    newcomer_fit,
    newcomer_model,
    newcomer_primal,
    newcomer_sdca,
    newcomer_server_quantities,
    ofmtl_omega_step,
    omega_from_sigma,
)
from fmtl_flower.core.omega import sigma_probabilistic
from fmtl_flower.core.rng import coordinate_order


def make_task(rng, n, d, noise=0.5):
    X = rng.normal(size=(n, d))
    y = np.sign(X @ rng.normal(size=d) + noise * rng.normal(size=n))
    y[y == 0] = 1.0
    return X, y


def old_state(rng, d, m):
    """Frozen old models and an extended, Omega-stepped Sigma with non-zero coupling."""
    W_old = rng.normal(size=(d, m))
    w_guess = W_old @ rng.normal(size=m) / m + 0.3 * rng.normal(size=d)
    sigma = sigma_probabilistic(np.column_stack([W_old, w_guess]))
    return W_old, sigma, omega_from_sigma(sigma)


def qp_primal(X, y, omega, c, lam):
    """The newcomer's primal as a QP in (w, xi), solved by SLSQP: no duality involved.

    min (1/n) sum xi + (lam/2) omega |w|^2 + lam c^T w  s.t.  xi >= 0, xi >= 1 - y x^T w.
    """
    n, d = X.shape
    yX = y[:, None] * X

    def f(z):
        w, xi = z[:d], z[d:]
        return xi.sum() / n + 0.5 * lam * omega * w @ w + lam * c @ w

    def grad(z):
        w = z[:d]
        return np.concatenate([lam * omega * w + lam * c, np.full(n, 1.0 / n)])

    A = np.hstack([yX, np.eye(n)])  # y x^T w + xi - 1 >= 0
    cons = [{"type": "ineq", "fun": lambda z: A @ z - 1.0, "jac": lambda z: A}]
    z0 = np.concatenate([np.zeros(d), np.ones(n)])
    res = scipy.optimize.minimize(f, z0, jac=grad, constraints=cons, method="SLSQP",
                                  bounds=[(None, None)] * d + [(0.0, None)] * n,
                                  options={"ftol": 1e-14, "maxiter": 1000})
    assert res.success, res.message
    return res.x[:d], res.fun


# ----------------------------------------------------------------------------- (a) optimum


@pytest.mark.parametrize("case", range(4))
def test_fit_reaches_independent_qp_optimum(case):
    rng = np.random.default_rng(100 + case)
    n, d, m = [(25, 3, 2), (40, 5, 4), (15, 6, 3), (30, 2, 6)][case]
    lam = [0.1, 0.01, 1.0, 0.05][case]
    X, y = make_task(rng, n, d)
    W_old, _, omega_mat = old_state(rng, d, m)
    omega, c = newcomer_server_quantities(W_old, omega_mat)
    fit = newcomer_fit(X, y, omega=omega, c=c, lam=lam, rounds=2000, local_frac=1.0,
                       seed=7, task_id=m)
    w_qp, p_qp = qp_primal(X, y, omega, c, lam)
    np.testing.assert_allclose(fit.w, w_qp, rtol=1e-6, atol=1e-6 * np.linalg.norm(w_qp))
    p = newcomer_primal(X, y, fit.w, omega=omega, c=c, lam=lam)
    dual = newcomer_dual(X, y, fit.alpha, omega=omega, c=c, lam=lam)
    assert abs(p - p_qp) <= 1e-9 * max(1.0, abs(p_qp))
    assert abs(dual - p_qp) <= 1e-9 * max(1.0, abs(p_qp))  # strong duality
    np.testing.assert_allclose(fit.w, newcomer_model(X, fit.alpha, omega=omega, c=c, lam=lam))


def test_substitution_reduces_to_standard_svm_when_c_is_zero():
    """c = 0 (the state right after the extension): a plain SVM with strength lam * omega."""
    from fmtl_flower.core.svm import fit_linear_svm

    rng = np.random.default_rng(3)
    X, y = make_task(rng, 30, 4)
    lam, omega = 0.05, 4.0
    fit = newcomer_fit(X, y, omega=omega, c=np.zeros(4), lam=lam, rounds=1500,
                       local_frac=1.0, seed=0, task_id=0)
    w_svm, rel_gap = fit_linear_svm(X, y, lam * omega, tol=1e-13, max_epochs=20000,
                                    check_every=1)
    np.testing.assert_allclose(fit.w, w_svm, rtol=1e-6, atol=1e-8)


# ----------------------------------------------------------------------------- (b) gap


def test_gap_nonnegative_dual_monotone_and_shrinking():
    rng = np.random.default_rng(11)
    X, y = make_task(rng, 60, 5, noise=1.0)
    W_old, _, omega_mat = old_state(rng, 5, 3)
    omega, c = newcomer_server_quantities(W_old, omega_mat)
    fit = newcomer_fit(X, y, omega=omega, c=c, lam=0.02, rounds=1000, local_frac=0.5,
                       seed=1, task_id=3)
    gaps, duals = fit.gaps, fit.duals
    assert gaps.shape == duals.shape == (1001,)
    assert np.all(gaps >= -1e-14)
    assert np.all(np.diff(duals) >= -1e-14)  # every step maximises the dual exactly
    # the gap is not monotone round to round (nor is the primal), but its running minimum
    # shrinks by orders of magnitude: fast at first, a plateau while the active set settles
    # (measured: ~2e-5 from round 50 to 300), then linear convergence
    best = np.minimum.accumulate(gaps)
    assert best[20] < 0.01 * gaps[0]
    assert best[500] < 1e-5 * gaps[0]
    assert gaps[-1] < 1e-10
    # gap = primal - dual, computed independently
    p = newcomer_primal(X, y, fit.w, omega=omega, c=c, lam=0.02)
    d = newcomer_dual(X, y, fit.alpha, omega=omega, c=c, lam=0.02)
    np.testing.assert_allclose(gaps[-1], p - d, atol=1e-12)


def test_gap_at_zero_and_continuation():
    rng = np.random.default_rng(5)
    X, y = make_task(rng, 20, 3)
    c = rng.normal(size=3)
    kw = dict(omega=2.0, c=c, lam=0.1)
    alpha0 = np.zeros(20)
    w0 = newcomer_model(X, alpha0, **kw)
    np.testing.assert_allclose(w0, -c / 2.0)
    gap0 = newcomer_duality_gap(X, y, alpha0, **kw)
    p0 = newcomer_primal(X, y, w0, **kw)
    np.testing.assert_allclose(gap0, p0 - newcomer_dual(X, y, alpha0, **kw), atol=1e-14)
    # two calls of 10 rounds = one call of 20 rounds (same orders, alpha carried over)
    a = newcomer_fit(X, y, rounds=10, local_frac=0.5, seed=2, task_id=1, **kw)
    b = newcomer_fit(X, y, rounds=10, local_frac=0.5, seed=2, task_id=1, alpha=a.alpha,
                     first_round=11, **kw)
    full = newcomer_fit(X, y, rounds=20, local_frac=0.5, seed=2, task_id=1, **kw)
    np.testing.assert_array_equal(b.alpha, full.alpha)
    np.testing.assert_array_equal(b.w, full.w)
    again = newcomer_fit(X, y, rounds=20, local_frac=0.5, seed=2, task_id=1, **kw)
    np.testing.assert_array_equal(again.alpha, full.alpha)  # reproducible
    assert newcomer_fit(X, y, rounds=3, local_frac=0.5, seed=2, task_id=1,
                        track_gap=False, **kw).gaps.size == 0


def test_zero_norm_rows_reach_their_optimum():
    rng = np.random.default_rng(8)
    X, y = make_task(rng, 20, 3)
    X[[3, 11]] = 0.0
    kw = dict(omega=1.5, c=rng.normal(size=3) * 0.2, lam=0.1)
    fit = newcomer_fit(X, y, rounds=500, local_frac=1.0, seed=0, task_id=0, **kw)
    np.testing.assert_array_equal(y[[3, 11]] * fit.alpha[[3, 11]], 1.0)
    assert fit.gaps[-1] < 1e-10  # skipping them would leave a gap of 2/20


# ----------------------------------------------------------------------------- (c) extension


def test_extend_sigma_trace_blocks_psd():
    rng = np.random.default_rng(2)
    for m in (1, 2, 5):
        A = rng.normal(size=(m, m))
        sigma = A @ A.T + 0.1 * np.eye(m)
        sigma /= np.trace(sigma)
        ext = extend_sigma(sigma)
        assert ext.shape == (m + 1, m + 1)
        np.testing.assert_allclose(np.trace(ext), 1.0, atol=1e-14)
        np.testing.assert_allclose(ext[:m, :m], sigma * m / (m + 1))
        assert np.all(ext[m, :m] == 0) and np.all(ext[:m, m] == 0)
        assert ext[m, m] == 1.0 / (m + 1)
        np.testing.assert_array_equal(ext, ext.T)
        assert np.linalg.eigvalsh(ext).min() > 0
        omega = omega_from_sigma(ext)
        np.testing.assert_allclose(omega @ ext, np.eye(m + 1), atol=1e-10)
        np.testing.assert_array_equal(omega, omega.T)
        # the extended Omega is blockdiag((m+1)/m Omega_old, m+1): no coupling at the start
        np.testing.assert_allclose(omega[:m, :m], omega_from_sigma(sigma) * (m + 1) / m,
                                   rtol=1e-10)
        assert np.isclose(omega[m, m], m + 1)
        _, c = newcomer_server_quantities(rng.normal(size=(4, m)), omega)
        np.testing.assert_allclose(c, 0.0, atol=1e-12)
    np.testing.assert_array_equal(extend_sigma(np.eye(3) / 3), np.diag([0.25] * 4))
    np.testing.assert_array_equal(extend_sigma(np.zeros((0, 0))), [[1.0]])
    # PSD (singular) Sigma is accepted; its Omega is not defined
    singular = extend_sigma(np.array([[1.0, 0.0], [0.0, 0.0]]))
    assert np.isclose(np.trace(singular), 1.0)
    with pytest.raises(ValueError, match="positive definite"):
        omega_from_sigma(singular)


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.eye(3) / 2, "unit trace"),
        (np.array([[0.5, 0.2], [0.1, 0.5]]), "symmetric"),
        (np.array([[1.5, 0.0], [0.0, -0.5]]), "semidefinite"),
        (np.array([[0.5, 0.9], [0.9, 0.5]]), "semidefinite"),
        (np.ones((2, 3)) / 2, "square"),
        (np.array([[np.nan]]), "non-finite"),
    ],
)
def test_extend_sigma_rejects_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        extend_sigma(bad)


# ----------------------------------------------------------------------------- (d) = MOCHA


@pytest.mark.parametrize("s2", [np.inf, 3.0])
def test_newcomer_problem_is_mocha_column_subproblem(s2):
    """P_new(w) and MOCHA's full P([W_old, w]) differ by a constant; optimality carries over."""
    rng = np.random.default_rng(21)
    d, m, lam = 4, 3, 0.05
    old_tasks = [make_task(rng, 15, d) for _ in range(m)]
    X, y = make_task(rng, 25, d)
    W_old, sigma, _ = old_state(rng, d, m)
    form = make_formulation("probabilistic", m + 1, lam=lam, s2=s2)
    form.set_omega(sigma)
    K = form.regulariser_matrix()
    # the general rule: omega = K_mm / lam and c = W_old K[:m, m] / lam
    omega, c = newcomer_server_quantities(W_old, K / lam)
    if np.isinf(s2):
        o2, c2 = newcomer_server_quantities(W_old, omega_from_sigma(sigma))
        np.testing.assert_allclose([omega, *c], [o2, *c2], rtol=1e-10, atol=1e-12)
    else:
        np.testing.assert_allclose(omega, omega_from_sigma(sigma)[m, m] + 1.0 / s2, rtol=1e-10)

    def full(w):
        W = np.column_stack([W_old, w])
        losses = sum(mean_hinge_loss(Xt, yt, W_old[:, t]) for t, (Xt, yt) in
                     enumerate(old_tasks))
        return losses + mean_hinge_loss(X, y, w) + form.objective(W)

    kw = dict(omega=omega, c=c, lam=lam)
    offsets = [full(w) - newcomer_primal(X, y, w, **kw) for w in rng.normal(size=(5, d)) * 3]
    np.testing.assert_allclose(offsets, offsets[0], rtol=1e-11)

    fit = newcomer_fit(X, y, rounds=1500, local_frac=1.0, seed=4, task_id=m, **kw)
    gap = fit.gaps[-1]
    assert gap < 1e-12
    w = fit.w
    W = np.column_stack([W_old, w])
    # stationarity of the full objective in column m: grad of (1/2) tr(W K W^T) in w is
    # (W K)[:, m], and the hinge subgradient is -X^T alpha / n
    np.testing.assert_allclose((W @ K)[:, m], X.T @ fit.alpha / len(y), rtol=1e-9, atol=1e-12)
    # the hinge subgradient is a valid one at w: a_i = 1 below the margin, 0 above it
    # (each term of the gap is (1 - a_i)(1 - margin_i) or a_i (margin_i - 1), so the gap
    # bounds how far a_i can be from the right value)
    a, margins, delta = y * fit.alpha, y * (X @ w), 1e-4
    slack = len(y) * max(gap, 0.0) / delta + 1e-12
    assert np.all(a[margins < 1 - delta] >= 1 - slack)
    assert np.all(a[margins > 1 + delta] <= slack)
    # and no perturbation of column m improves the full objective
    best = full(w)
    for u in rng.normal(size=(20, d)):
        for t in (1e-3, 1e-1):
            assert full(w + t * u) >= best - 1e-12


# ----------------------------------------------------------------------------- (e) message


def test_server_quantities_are_d_plus_one_floats():
    rng = np.random.default_rng(4)
    d, m = 7, 5
    W_old, _, omega_mat = old_state(rng, d, m)
    omega, c = newcomer_server_quantities(W_old, omega_mat)
    assert isinstance(omega, float)
    assert c.shape == (d,) and c.dtype == np.float64
    assert 1 + c.size == d + 1
    direct = np.zeros(d)
    for t in range(m):
        direct += omega_mat[t, m] * W_old[:, t]
    np.testing.assert_allclose(c, direct, rtol=1e-12, atol=1e-14)
    assert omega == omega_mat[m, m]
    with pytest.raises(ValueError, match="shape"):
        newcomer_server_quantities(W_old, omega_mat[:m, :m])
    with pytest.raises(ValueError, match="> 0"):
        newcomer_server_quantities(W_old, -omega_mat)


def test_omega_step_reuses_mocha_numerics():
    rng = np.random.default_rng(6)
    W = rng.normal(size=(3, 6))  # m + 1 > d: rank-deficient W^T W
    sigma, omega = ofmtl_omega_step(W)
    np.testing.assert_array_equal(sigma, sigma_probabilistic(W))
    np.testing.assert_allclose(omega @ sigma, np.eye(6), atol=1e-9)
    sigma2, _ = ofmtl_omega_step(W, eps_rel=1e-2)
    np.testing.assert_array_equal(sigma2, sigma_probabilistic(W, 1e-2))
    np.testing.assert_allclose(ofmtl_omega_step(np.zeros((3, 4)))[1], 4 * np.eye(4))


def test_alternating_ofmtl_loop_keeps_pairs_consistent():
    """Extension -> fit -> Omega-step -> refresh with the new (omega, c), alpha carried over."""
    rng = np.random.default_rng(9)
    d, m, lam = 5, 3, 0.05
    W_old, _, _ = old_state(rng, d, m)
    sigma_old = sigma_probabilistic(W_old)
    X, y = make_task(rng, 30, d)
    sigma = extend_sigma(sigma_old)
    omega_mat = omega_from_sigma(sigma)
    alpha = None
    for _ in range(4):
        omega, c = newcomer_server_quantities(W_old, omega_mat)
        fit = newcomer_fit(X, y, omega=omega, c=c, lam=lam, rounds=50, local_frac=0.5,
                           seed=0, task_id=m, alpha=alpha)
        if alpha is not None:  # the refresh alone already gives the consistent model
            np.testing.assert_allclose(fit.gaps[0], newcomer_duality_gap(
                X, y, alpha, omega=omega, c=c, lam=lam))
        assert np.all(fit.gaps >= -1e-14)
        alpha = fit.alpha
        sigma, omega_mat = ofmtl_omega_step(np.column_stack([W_old, fit.w]))
        np.testing.assert_allclose(np.trace(sigma), 1.0)
    assert fit.gaps[-1] < 1e-3 * fit.gaps[0] + 1e-10


# ----------------------------------------------------------------------------- (f) property


def reference_step_loop(X, y, alpha, w, omega, lam, budget, order):
    """Plain-numpy exact SDCA on D_new (zero rows go to a = 1)."""
    n = X.shape[0]
    alpha = alpha.copy()
    w = w.copy()
    for s in range(budget):
        i = order[s % n]
        x = X[i]
        xx = x @ x
        a_old = y[i] * alpha[i]
        if xx == 0:
            a_new = 1.0
        else:
            a_new = np.clip(a_old + lam * omega * n * (1 - y[i] * (x @ w)) / xx, 0, 1)
        delta = y[i] * (a_new - a_old)
        alpha[i] += delta
        w += delta * x / (lam * omega * n)
    return alpha


@st.composite
def newcomer_problems(draw):
    n = draw(st.integers(1, 25))
    d = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)) * draw(st.sampled_from([0.01, 1.0, 30.0]))
    if draw(st.booleans()):
        X[rng.integers(n)] = 0.0
    y = rng.choice([-1.0, 1.0], size=n)
    alpha = y * rng.uniform(0, 1, size=n) * draw(st.sampled_from([0.0, 1.0]))
    if draw(st.booleans()):  # some coordinates exactly at the bounds of the box
        at_one = rng.random(n) < 0.3
        alpha[at_one] = y[at_one]
        alpha[rng.random(n) < 0.3] = 0.0
    c = rng.normal(size=d) * draw(st.sampled_from([0.0, 0.1, 10.0]))
    omega = draw(st.sampled_from([1e-3, 1.0, 7.5, 1e4]))
    lam = draw(st.sampled_from([1e-5, 1e-2, 1.0]))
    budget = draw(st.integers(0, 3 * n))
    return X, y, alpha, c, omega, lam, budget, coordinate_order(seed, 1, 2, n)


@settings(max_examples=150, deadline=None)
@given(newcomer_problems())
def test_sdca_keeps_dual_feasible_and_ascends(problem):
    X, y, alpha, c, omega, lam, budget, order = problem
    kw = dict(omega=omega, c=c, lam=lam)
    w = newcomer_model(X, alpha, **kw)
    new = newcomer_sdca(X, y, alpha, w, omega=omega, lam=lam, budget=budget, order=order)
    a = y * new
    assert np.all(a >= 0.0) and np.all(a <= 1.0)  # exactly inside the box
    ref = reference_step_loop(X, y, alpha, w, omega, lam, budget, order)
    scale = max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(new, ref, rtol=1e-7, atol=1e-9 * scale)
    d0 = newcomer_dual(X, y, alpha, **kw)
    d1 = newcomer_dual(X, y, new, **kw)
    assert d1 >= d0 - 1e-9 * max(1.0, abs(d0))
    assert newcomer_duality_gap(X, y, new, **kw) >= -1e-9 * max(1.0, abs(d1))
    np.testing.assert_array_equal(alpha, problem[2])  # input not modified


def test_sdca_validates_input():
    X = np.ones((3, 2))
    y = np.array([1.0, -1.0, 1.0])
    ok = dict(omega=1.0, lam=0.1, budget=2, order=np.arange(3))
    with pytest.raises(ValueError, match="alpha"):
        newcomer_sdca(X, y, np.array([2.0, 0, 0]), np.zeros(2), **ok)
    with pytest.raises(ValueError, match="omega"):
        newcomer_sdca(X, y, np.zeros(3), np.zeros(2), **{**ok, "omega": 0.0})
    with pytest.raises(ValueError, match="budget"):
        newcomer_sdca(X, y, np.zeros(3), np.zeros(2), **{**ok, "budget": -1})
    with pytest.raises(ValueError, match="order"):
        newcomer_sdca(X, y, np.zeros(3), np.zeros(2), **{**ok, "order": np.arange(2)})
    with pytest.raises(ValueError, match="labels"):
        newcomer_sdca(X, np.array([1.0, 0.0, 1.0]), np.zeros(3), np.zeros(2), **ok)
    with pytest.raises(ValueError, match="w must"):
        newcomer_sdca(X, y, np.zeros(3), np.zeros(3), **ok)
    np.testing.assert_array_equal(
        newcomer_sdca(X, y, np.zeros(3), np.zeros(2), **{**ok, "budget": 0}), np.zeros(3))


# ----------------------------------------------------------------------------- (g) add_task


def unit_trace_sigma(rng, m):
    A = rng.normal(size=(m, m))
    sigma = A @ A.T + 0.2 * np.eye(m)
    return sigma / np.trace(sigma)


@pytest.mark.parametrize("case", range(4))
def test_add_task_newcomer_solves_its_subproblem_for_the_final_omega(case):
    """The final w is the QP optimum for the Omega of the final SDCA, rebuilt independently."""
    from fmtl_flower.core.ofmtl import add_task

    rng = np.random.default_rng(300 + case)
    n, d, m, lam, outer = [(25, 3, 2, 0.1, 1), (40, 5, 4, 0.01, 3), (15, 6, 3, 1.0, 2),
                           (30, 2, 6, 0.05, 4)][case]
    X, y = make_task(rng, n, d)
    W_old = rng.normal(size=(d, m))
    Sigma_old = unit_trace_sigma(rng, m)
    W_in, S_in = W_old.copy(), Sigma_old.copy()
    res = add_task(W_old, Sigma_old, X, y, lam=lam, outer=outer, inner=2000, local_frac=1.0,
                   seed=3, task_id=m)
    np.testing.assert_array_equal(W_old, W_in)  # inputs untouched
    np.testing.assert_array_equal(Sigma_old, S_in)
    assert res.W.shape == (d, m + 1) and res.Sigma.shape == (m + 1, m + 1)
    np.testing.assert_array_equal(res.W[:, :m], W_old)  # old columns bit for bit
    # the Sigma of the final SDCA: the extension (outer = 1), else the Omega-step of the
    # previous iteration's [W_old, w], built here from the formulas, not from ofmtl.py
    if outer == 1:
        sigma = np.zeros((m + 1, m + 1))
        sigma[:m, :m] = Sigma_old * m / (m + 1)
        sigma[m, m] = 1.0 / (m + 1)
    else:
        W_prev = np.column_stack([W_old, res.ws[-2]])
        evals, evecs = np.linalg.eigh(W_prev.T @ W_prev)
        evals = np.clip(evals, 0, None)
        roots = np.sqrt(evals + 1e-3 * evals[-1])
        sigma = evecs @ np.diag(roots) @ evecs.T / roots.sum()
    np.testing.assert_allclose(res.Sigma, sigma, rtol=1e-9, atol=1e-12)
    omega_mat = np.linalg.inv(sigma)
    omega = omega_mat[m, m]
    c = sum(omega_mat[t, m] * W_old[:, t] for t in range(m))
    np.testing.assert_allclose([res.omega, *res.c], [omega, *c], rtol=1e-8, atol=1e-10)
    w_qp, p_qp = qp_primal(X, y, omega, c, lam)
    np.testing.assert_allclose(res.w, w_qp, rtol=1e-6, atol=1e-6 * np.linalg.norm(w_qp))
    assert res.gaps[-1] < 1e-10
    # the recorded primal is P_new plus the frozen columns' part of the regulariser
    frozen = 0.5 * lam * float(np.einsum("ij,ij->", W_old @ omega_mat[:m, :m], W_old))
    np.testing.assert_allclose(res.primals[-1], p_qp + frozen, rtol=1e-8)


def test_add_task_defaults_sigma_trace_and_communication_independent_of_m():
    from fmtl_flower.core.ofmtl import add_task

    rng = np.random.default_rng(17)
    d, n = 6, 50
    X, y = make_task(rng, n, d)
    counts = []
    for m in (1, 3, 12):  # m > d included: a rank-deficient Gram matrix
        W_old = rng.normal(size=(d, m))
        res = add_task(W_old, sigma_probabilistic(W_old), X, y, lam=0.05, seed=1, task_id=m)
        assert res.messages == 10  # the reference's outer = 10 round trips
        assert res.floats_sent == 10 * (d + 1) and res.floats_received == 10 * d
        assert res.floats_communicated == 10 * (2 * d + 1)
        counts.append((res.floats_sent, res.floats_received, res.messages))
        np.testing.assert_allclose(np.trace(res.Sigma), 1.0, atol=1e-12)
        np.testing.assert_array_equal(res.Sigma, res.Sigma.T)
        assert np.linalg.eigvalsh(res.Sigma).min() > 0
        np.testing.assert_allclose(res.Omega @ res.Sigma, np.eye(m + 1), atol=1e-8)
        np.testing.assert_array_equal(res.W[:, :m], W_old)
        assert res.gaps.shape == res.primals.shape == (10,) and res.ws.shape == (10, d)
        assert np.all(res.gaps >= -1e-14) and res.gaps[-1] < 1e-3
        np.testing.assert_array_equal(res.ws[-1], res.w)
        np.testing.assert_allclose(res.w, newcomer_model(X, res.alpha, omega=res.omega,
                                                         c=res.c, lam=0.05))
    assert len(set(counts)) == 1  # O(1) per newcomer: nothing depends on m


@pytest.mark.parametrize("variant", ["plain", "zero-rows", "no-steps", "m>d"])
def test_add_task_is_the_manual_protocol_bit_for_bit(variant):
    """The parity reference: extension, then fit / Omega-step with the existing functions."""
    from fmtl_flower.core.ofmtl import add_task

    rng = np.random.default_rng(23)
    d, m, lam, outer, inner = 4, 5, 0.02, 3, 7
    frac = 0.01 if variant == "no-steps" else 0.5  # floor(0.01 * 33) = 0 steps per round
    if variant == "m>d":
        d, m, frac = 3, 8, 1.7  # coordinates revisited within a round
    X, y = make_task(rng, 33, d)
    if variant == "zero-rows":
        X[[0, 5, 17]] = 0.0
    W_old = rng.normal(size=(d, m))
    Sigma_old = sigma_probabilistic(W_old)
    res = add_task(W_old, Sigma_old, X, y, lam=lam, outer=outer, inner=inner,
                   local_frac=frac, seed=9, task_id=m)
    sigma = extend_sigma(Sigma_old)
    omega_mat = omega_from_sigma(sigma)
    W = np.column_stack([W_old, np.zeros(d)])
    alpha = None
    for k in range(outer):
        omega, c = newcomer_server_quantities(W_old, omega_mat)
        fit = newcomer_fit(X, y, omega=omega, c=c, lam=lam, rounds=inner, local_frac=frac,
                           seed=9, task_id=m, alpha=alpha, first_round=k * inner + 1)
        alpha, W[:, m] = fit.alpha, fit.w
        np.testing.assert_array_equal(res.ws[k], fit.w)
        np.testing.assert_allclose(res.gaps[k], fit.gaps[-1], rtol=1e-12, atol=1e-15)
        if k < outer - 1:
            sigma, omega_mat = ofmtl_omega_step(W)
    np.testing.assert_array_equal(res.W, W)
    np.testing.assert_array_equal(res.Sigma, sigma)  # no Omega-step after the last iteration
    np.testing.assert_array_equal(res.alpha, alpha)
    again = add_task(W_old, Sigma_old, X, y, lam=lam, outer=outer, inner=inner,
                     local_frac=frac, seed=9, task_id=m)
    np.testing.assert_array_equal(again.W, res.W)  # reproducible
    if variant == "zero-rows":
        np.testing.assert_array_equal(y[[0, 5, 17]] * res.alpha[[0, 5, 17]], 1.0)
    if variant == "no-steps":
        np.testing.assert_array_equal(res.alpha, 0.0)


def test_add_task_first_task_is_a_plain_svm():
    """m = 0: Sigma = [[1]], c = 0, so the newcomer solves an SVM with strength lam."""
    from fmtl_flower.core.ofmtl import add_task
    from fmtl_flower.core.svm import fit_linear_svm

    rng = np.random.default_rng(29)
    X, y = make_task(rng, 30, 4)
    res = add_task(np.zeros((4, 0)), np.zeros((0, 0)), X, y, lam=0.05, outer=2, inner=1500,
                   local_frac=1.0)
    np.testing.assert_array_equal(res.Sigma, [[1.0]])  # the Omega-step of one column
    w_svm, _ = fit_linear_svm(X, y, 0.05, tol=1e-13, max_epochs=20000, check_every=1)
    np.testing.assert_allclose(res.w, w_svm, rtol=1e-6, atol=1e-8)
    assert res.floats_sent == 2 * 5 and res.floats_received == 2 * 4 and res.messages == 2


@pytest.mark.parametrize(
    "change, match",
    [
        ({"W_old": np.ones(3)}, "2-D"),
        ({"W_old": np.full((3, 2), np.nan)}, "non-finite"),
        ({"X": np.ones((5, 4))}, "features"),
        ({"Sigma_old": np.eye(3) / 3}, "shape"),
        ({"Sigma_old": np.eye(2)}, "unit trace"),
        ({"y": np.zeros(5)}, "labels"),
        ({"lam": 0.0}, "lam"),
        ({"outer": 0}, "outer"),
        ({"inner": -1}, "inner"),
        ({"local_frac": 0.0}, "local_frac"),
    ],
)
def test_add_task_validates_input(change, match):
    from fmtl_flower.core.ofmtl import add_task

    args = {"W_old": np.ones((3, 2)), "Sigma_old": np.eye(2) / 2, "X": np.ones((5, 3)),
            "y": np.ones(5), "lam": 0.1, "outer": 2, "inner": 1, "local_frac": 0.5}
    args.update(change)
    W_old, Sigma_old, X, y = (args.pop(k) for k in ("W_old", "Sigma_old", "X", "y"))
    with pytest.raises(ValueError, match=match):
        add_task(W_old, Sigma_old, X, y, **args)
