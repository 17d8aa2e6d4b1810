"""The Omega formulations of MOCHA's appendix B: M = K^-1, Omega-steps, sigma' and (28)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

from fmtl_flower.core.formulations import (
    FORMULATIONS,
    SIGMA_MODES,
    ClusteredFormulation,
    GraphicalFormulation,
    clustered_eigenvalues,
    graphical_lasso_gap,
    make_formulation,
    sigma_prime,
    solve_graphical_lasso,
)
from fmtl_flower.core.omega import sigma_identity, sigma_probabilistic
from fmtl_flower.core.sdca import sdca_local_update

NAMES = ("identity", "mean", "probabilistic", "clustered", "graphical")


def build(name, m, rng, *, gamma=1.0, **overrides):
    """A formulation with random valid hyper-parameters."""
    opts = {"lam": 10.0 ** rng.uniform(-3, 0), "gamma": gamma}
    if name == "mean":
        opts["lam2"] = 10.0 ** rng.uniform(-3, 0)
    elif name == "probabilistic":
        opts["s2"] = [None, math.inf, 10.0 ** rng.uniform(-1, 2)][rng.integers(3)]
    elif name == "clustered":
        opts["eta"] = 10.0 ** rng.uniform(-2, 1)
        opts["k"] = float(rng.uniform(0.1, m))
    elif name == "graphical":
        opts["lam2"] = [0.0, 10.0 ** rng.uniform(-3, 0)][rng.integers(2)] * opts["lam"]
        opts["s2"] = 10.0 ** rng.uniform(-1, 2)
    opts.update(overrides)
    return make_formulation(name, m, **opts)


def random_models(rng, d, m):
    W = rng.normal(size=(d, m)) * 10.0 ** rng.uniform(-2, 1)
    if m > 2 and rng.random() < 0.3:
        W[:, rng.integers(m)] = 0.0  # a task whose model is still 0
    return W


def check_inverse(f, m):
    M, K = f.inverse_matrix(), f.regulariser_matrix()
    assert M.shape == K.shape == (m, m)
    np.testing.assert_array_equal(M, M.T)
    assert np.linalg.eigvalsh(M).min() > 0
    scale = np.linalg.norm(M, 2) * np.linalg.norm(K, 2)
    np.testing.assert_allclose(M @ K, np.eye(m), atol=1e-10 * scale)
    np.testing.assert_array_equal(f.m_diag(), np.diag(M))


def test_registry_names_and_fixed_flags():
    assert tuple(FORMULATIONS) == NAMES
    assert SIGMA_MODES == ("global", "per-task", "spectral")
    rng = np.random.default_rng(0)
    fixed = {name: build(name, 4, rng).fixed for name in NAMES}
    assert fixed == {
        "identity": True,
        "mean": True,
        "probabilistic": False,
        "clustered": False,
        "graphical": False,
    }
    for name in NAMES:
        f = build(name, 4, rng)
        assert f.name == name and f.num_tasks == 4 and isinstance(f, FORMULATIONS[name])


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(d=st.integers(1, 8), m=st.integers(1, 9), seed=st.integers(0, 10**6))
def test_inverse_is_spd_and_inverts_k(name, d, m, seed):
    rng = np.random.default_rng(seed)
    f = build(name, m, rng)
    check_inverse(f, m)  # initial state
    W = random_models(rng, d, m)
    for _ in range(2):
        f.omega_step(W)
        check_inverse(f, m)
        # R(W) = (1/2) tr(W K W^T) + c(Omega): the W part and the Omega-only part
        K = f.regulariser_matrix()
        quad = 0.5 * np.trace(W @ K @ W.T)
        rest = f.omega_objective(d)
        assert rest == f.objective(np.zeros_like(W))
        if name != "graphical":
            assert rest == 0.0
        assert np.isclose(
            f.objective(W) - quad, rest, rtol=1e-9, atol=1e-9 * (abs(quad) + abs(rest) + 1e-300)
        )
        W = random_models(rng, d, m)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=20, deadline=None)
@given(d=st.integers(1, 8), m=st.integers(1, 9), seed=st.integers(0, 10**6))
def test_omega_step_does_not_increase_the_objective(name, d, m, seed):
    """For fixed W the Omega-step minimises step_objective(W); that is the whole objective
    R(W) = (1/2) tr(W K W^T) + c(Omega) except for the eps-perturbed steps (probabilistic,
    graphical with lam2 = 0), so R(W) never increases (graphical: up to the certified gap)."""
    rng = np.random.default_rng(seed)
    f = build(name, m, rng)
    W = random_models(rng, d, m)
    f.omega_step(random_models(rng, d, m))  # some other data-driven Omega to start from
    exact = name in ("identity", "mean", "clustered") or (name == "graphical" and f.lam2 > 0)
    for _ in range(2):  # from another Omega, then from the optimum itself
        before, whole_before = f.step_objective(W), f.objective(W)
        f.omega_step(W)
        after, whole_after = f.step_objective(W), f.objective(W)
        # the graphical lasso is solved to a certified duality gap (lam d / 2) * last_gap
        slack = 0.5 * f.lam * d * f.last_gap if name == "graphical" and f.last_gap else 0.0
        assert after <= before + 1e-11 * abs(before) + slack + 1e-300
        if exact:
            assert after == whole_after
            assert whole_after <= whole_before + 1e-11 * abs(whole_before) + slack + 1e-300


@settings(max_examples=40, deadline=None)
@given(d=st.integers(1, 6), m=st.integers(1, 8), seed=st.integers(0, 10**6))
def test_clustered_step_beats_every_feasible_omega(d, m, seed):
    """Exact minimiser of tr(W (eta I + Q)^-1 W^T) over {0 <= Q <= I, tr Q = k}."""
    rng = np.random.default_rng(seed)
    f = build("clustered", m, rng)
    W = random_models(rng, d, m)
    f.omega_step(W)
    best = f.objective(W)
    q = f.omega_eigenvalues
    assert np.all((q >= 0) & (q <= 1)) and np.isclose(q.sum(), f.k)
    Omega = f.omega
    np.testing.assert_allclose(
        f.inverse_matrix(), (f.eta * np.eye(m) + Omega) / f.lam, atol=1e-13 * (f.eta + 1) / f.lam
    )
    other = ClusteredFormulation(m, lam=f.lam, eta=f.eta, k=f.k)
    for _ in range(10):
        V, _ = np.linalg.qr(rng.normal(size=(m, m)))
        z = rng.normal(size=m)
        z -= z.mean()
        base = f.k / m
        room = min(base, 1 - base)
        q = base + (room * z / np.abs(z).max() if np.abs(z).max() > 0 else 0.0)
        other.set_omega((V * q) @ V.T)
        assert best <= other.objective(W) * (1 + 1e-10) + 1e-300


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 7), seed=st.integers(0, 10**6))
def test_clustered_eigenvalues_solve_the_reduced_problem(m, seed):
    """The breakpoint search agrees with a generic constrained solver (SLSQP)."""
    rng = np.random.default_rng(seed)
    mu = rng.exponential(size=m) * (rng.random(m) < 0.8)
    eta = 10.0 ** rng.uniform(-2, 1)
    k = float(rng.uniform(0.1, m))
    q = clustered_eigenvalues(mu, eta, k)
    assert np.isclose(q.sum(), k) and np.all((q >= 0) & (q <= 1))

    def value(x):
        return float(np.sum(mu / (eta + x)))

    res = minimize(
        value,
        np.full(m, k / m),
        jac=lambda x: -mu / (eta + x) ** 2,
        bounds=[(0, 1)] * m,
        method="SLSQP",
        constraints=[{"type": "eq", "fun": lambda x: x.sum() - k, "jac": lambda x: np.ones(m)}],
        options={"ftol": 1e-14, "maxiter": 500},
    )
    # SLSQP's answer may violate sum x = k slightly; charge that at the largest gradient
    x = np.clip(res.x, 0, 1)
    slack = abs(x.sum() - k) * float(np.max(mu / eta**2, initial=0.0))
    assert value(q) <= value(x) + slack + 1e-9 * max(1.0, value(x))
    # KKT: one tau with q_i = clip(tau sqrt(mu_i) - eta, 0, 1) wherever mu_i > 0
    pos = mu > 0
    if pos.sum() > k:
        s = np.sqrt(mu[pos])
        inner = (q[pos] > 0) & (q[pos] < 1)
        taus = (q[pos][inner] + eta) / s[inner]
        tau = taus.mean() if taus.size else None
        if tau is not None:
            np.testing.assert_allclose(taus, tau, rtol=1e-9)
            np.testing.assert_allclose(q[pos], np.clip(tau * s - eta, 0, 1), atol=1e-9)


def test_clustered_degenerate_and_validation():
    np.testing.assert_allclose(clustered_eigenvalues(np.zeros(4), 1.0, 2.0), np.full(4, 0.5))
    # rank 1 < k: the positive direction gets 1, the rest share k - 1
    np.testing.assert_allclose(
        clustered_eigenvalues(np.array([0.0, 0.0, 3.0]), 0.5, 2.0), [0.5, 0.5, 1.0]
    )
    np.testing.assert_allclose(clustered_eigenvalues(np.array([1.0, 2.0]), 0.1, 2.0), [1, 1])
    f = make_formulation("clustered", 3, lam=2.0, eta=0.5, k=1.5)
    np.testing.assert_allclose(f.inverse_matrix(), (0.5 + 0.5) * np.eye(3) / 2.0)
    f.omega_step(np.zeros((2, 3)))
    np.testing.assert_allclose(f.omega, 0.5 * np.eye(3), atol=1e-15)
    with pytest.raises(ValueError, match="Omega"):
        f.set_omega(np.eye(3))  # trace 3 != k


def test_identity_matches_the_existing_core():
    lam, m = 0.3, 7
    f = make_formulation("identity", m, lam=lam)
    np.testing.assert_array_equal(f.inverse_matrix(), sigma_identity(m) / lam)
    np.testing.assert_allclose(f.inverse_matrix(), np.eye(m) / (lam * m), rtol=1e-15)
    np.testing.assert_allclose(f.regulariser_matrix(), lam * m * np.eye(m))
    W = np.random.default_rng(0).normal(size=(3, m))
    f.omega_step(W)
    np.testing.assert_array_equal(f.inverse_matrix(), sigma_identity(m) / lam)
    assert np.isclose(f.objective(W), 0.5 * lam * m * np.sum(W * W))
    np.testing.assert_allclose(f.sigma_prime("global"), np.ones(m))
    np.testing.assert_allclose(f.sigma_prime("spectral"), np.ones(m))


@settings(max_examples=30, deadline=None)
@given(d=st.integers(1, 6), m=st.integers(1, 9), seed=st.integers(0, 10**6))
def test_probabilistic_with_infinite_s2_is_the_existing_core(d, m, seed):
    rng = np.random.default_rng(seed)
    lam = 10.0 ** rng.uniform(-4, 1)
    eps_rel = 10.0 ** rng.uniform(-6, -1)
    f = make_formulation("probabilistic", m, lam=lam, eps_rel=eps_rel)
    np.testing.assert_array_equal(f.inverse_matrix(), sigma_identity(m) / lam)
    W = rng.normal(size=(d, m))
    f.omega_step(W)
    np.testing.assert_array_equal(f.inverse_matrix(), sigma_probabilistic(W, eps_rel) / lam)
    np.testing.assert_array_equal(f.sigma, sigma_probabilistic(W, eps_rel))
    for mode in ("global", "per-task"):
        np.testing.assert_allclose(
            f.sigma_prime(mode), sigma_prime(f.sigma, mode), rtol=1e-12
        )
    sigma = f.sigma
    assert np.isclose(f.objective(W), 0.5 * lam * np.trace(W @ np.linalg.solve(sigma, W.T)))
    # finite s2 adds lam/s2 to K: M = (Sigma^-1 + I/s2)^-1 / lam
    g = make_formulation("probabilistic", m, lam=lam, s2=2.0, eps_rel=eps_rel)
    g.omega_step(W)
    expected = np.linalg.inv(np.linalg.inv(sigma) + np.eye(m) / 2.0) / lam
    np.testing.assert_allclose(g.inverse_matrix(), expected, rtol=1e-9, atol=1e-12 / lam)


def test_mean_closed_form():
    lam, lam2, m = 0.7, 0.05, 5
    f = make_formulation("mean", m, lam=lam, lam2=lam2)
    Omega = np.linalg.matrix_power(np.eye(m) - np.ones((m, m)) / m, 2)
    K = lam * Omega + lam2 * np.eye(m)
    np.testing.assert_allclose(f.regulariser_matrix(), K, atol=1e-15)
    np.testing.assert_allclose(f.inverse_matrix(), np.linalg.inv(K), rtol=1e-12)
    W = np.random.default_rng(1).normal(size=(4, m))
    assert np.isclose(f.objective(W), 0.5 * np.trace(W @ K @ W.T))
    f.omega_step(W)
    np.testing.assert_allclose(f.regulariser_matrix(), K, atol=1e-15)
    one = make_formulation("mean", 1, lam=lam, lam2=lam2)
    np.testing.assert_allclose(one.inverse_matrix(), [[1.0 / lam2]])


def test_graphical_matches_the_inverse_gram_without_penalty_and_sklearn_with_it():
    rng = np.random.default_rng(3)
    d, m, lam, s2, eps_rel = 20, 5, 0.5, 4.0, 1e-3
    W = rng.normal(size=(d, m))
    f = make_formulation("graphical", m, lam=lam, lam2=0.0, s2=s2, eps_rel=eps_rel)
    np.testing.assert_allclose(f.omega, m * np.eye(m))
    f.omega_step(W)
    G = W.T @ W
    S = (G + eps_rel * np.linalg.eigvalsh(G)[-1] * np.eye(m)) / d
    np.testing.assert_allclose(f.omega, np.linalg.inv(S), rtol=1e-10)
    np.testing.assert_allclose(f.regulariser_matrix(), lam * (f.omega + np.eye(m) / s2))
    # lam2 = 0, W = 0: no minimiser (log det unbounded); Omega is kept
    before = f.omega
    f.omega_step(np.zeros((d, m)))
    np.testing.assert_array_equal(f.omega, before)
    # lam2 > 0: scikit-learn's graphical lasso (diagonal free) on S + alpha I, alpha on the
    # off-diagonal entries, alpha = 2 lam2 / (lam d); no eps
    from sklearn.covariance import graphical_lasso

    lam2 = 0.5
    alpha = 2 * lam2 / (lam * d)
    g = make_formulation("graphical", m, lam=lam, lam2=lam2, s2=s2, eps_rel=eps_rel)
    g.omega_step(W)
    assert g.last_solver == "sklearn" and g.last_gap <= g.tol * m
    _, prec = graphical_lasso(G / d + alpha * np.eye(m), alpha, tol=1e-12, enet_tol=1e-12,
                              max_iter=1000)
    np.testing.assert_allclose(g.omega, prec, atol=1e-5 * np.abs(prec).max())
    assert np.sum(g.omega == 0) > 0  # sparse
    assert g.step_objective(W) == g.objective(W)
    # W = 0 has a minimiser once the diagonal is penalised: Omega = I / alpha
    g.omega_step(np.zeros((d, m)))
    np.testing.assert_allclose(g.omega, np.eye(m) / alpha, rtol=1e-7)


def eq15(W, omega, *, paper_lambda, paper_lambda2, sigma2):
    """Eq. (15) of the MOCHA paper with lambda1 = 0, written as the paper writes it:
    lambda (|W|^2 / sigma^2 + tr(W Omega W^T) - d log|Omega|) + lambda2 |Omega|_1."""
    d = W.shape[0]
    return paper_lambda * (
        np.sum(W * W) / sigma2 + np.trace(W @ omega @ W.T) - d * np.linalg.slogdet(omega)[1]
    ) + paper_lambda2 * np.abs(omega).sum()


@settings(max_examples=25, deadline=None)
@given(d=st.integers(1, 8), m=st.integers(1, 8), seed=st.integers(0, 10**6))
def test_graphical_objective_is_eq_15_with_lam_twice_and_lam2_equal_to_the_papers(d, m, seed):
    """objective = eq. (15) with the paper's lambda = lam / 2 and lambda2 = lam2 (every entry
    of Omega penalised, the diagonal included)."""
    rng = np.random.default_rng(seed)
    f = build("graphical", m, rng, lam2=10.0 ** rng.uniform(-3, 0))
    W = random_models(rng, d, m)
    for _ in range(2):
        value = eq15(W, f.omega, paper_lambda=f.lam / 2, paper_lambda2=f.lam2, sigma2=f.s2)
        assert np.isclose(f.objective(W), value, rtol=1e-9, atol=1e-9 * (1 + abs(value)))
        f.omega_step(random_models(rng, d, m))


@settings(max_examples=25, deadline=None)
@given(d=st.integers(1, 8), m=st.integers(1, 8), seed=st.integers(0, 10**6))
def test_graphical_step_satisfies_the_optimality_conditions_of_eq_15(d, m, seed):
    """Subgradient of eq. (15) in Omega for fixed W: (lam/2)(W^T W - d Omega^-1) + lam2 Z = 0
    with Z_ij = sign(Omega_ij) where Omega_ij != 0 and |Z_ij| <= 1 elsewhere. The diagonal
    is positive, so Z_ii = 1: (Omega^-1)_ii = (W^T W)_ii / d + 2 lam2 / (lam d)."""
    rng = np.random.default_rng(seed)
    W = random_models(rng, d, m)
    # alpha = 2 lam2 / (lam d) from 1e-2 to 1 times the mean of diag(W^T W) / d: where the
    # solvers certify their gap (for alpha << S, ADMM can stop early; ``last_gap`` says so)
    lam = 10.0 ** rng.uniform(-3, 0)
    alpha = 10.0 ** rng.uniform(-2, 0) * np.sum(W * W) / (d * m)
    f = build("graphical", m, rng, lam=lam, lam2=alpha * lam * d / 2)
    f.omega_step(W)
    assert f.last_gap <= f.tol * m
    omega = f.omega
    Z = (f.lam / (2 * f.lam2)) * (d * np.linalg.inv(omega) - W.T @ W)
    tol = 1e-3
    np.testing.assert_allclose(np.diag(Z), 1.0, atol=tol)
    assert np.all(np.abs(Z) <= 1 + tol)
    big = np.abs(omega) > 1e-6 * np.abs(omega).max()
    np.testing.assert_allclose(Z[big], np.sign(omega[big]), atol=tol)


@settings(max_examples=25, deadline=None)
@given(d=st.integers(1, 8), m=st.integers(1, 8), seed=st.integers(0, 10**6),
       scale=st.sampled_from([0.0, 1e-8, 1e-3, 1.0]))
def test_graphical_objective_is_bounded_below(d, m, seed, scale):
    """With the diagonal penalised, c(Omega) >= sum over the eigenvalues mu of Omega of
    min_mu (lam2 mu - (lam d / 2) log mu) = m (lam d / 2) (1 - log(lam d / (2 lam2))), for
    every W, also W -> 0 (where the unpenalised diagonal let Omega, and -log det, blow up)."""
    rng = np.random.default_rng(seed)
    f = build("graphical", m, rng, lam2=10.0 ** rng.uniform(-3, 0))
    W = scale * rng.normal(size=(d, m))
    f.omega_step(W)
    c = 0.5 * f.lam * d
    bound = m * c * (1 - np.log(c / f.lam2))
    assert f.omega_objective(d) >= bound - 1e-9 * abs(bound)
    assert f.objective(W) >= bound - 1e-9 * abs(bound)
    # at the optimum tr((S + alpha I) Omega) + alpha |Omega|_off = m, so tr Omega <= m / alpha
    assert np.linalg.eigvalsh(f.omega)[-1] <= 1.0001 * m * c / f.lam2


def test_graphical_lasso_falls_back_to_admm_where_sklearn_fails():
    """m > d and a small penalty: scikit-learn raises 'Non SPD result'; ADMM certifies."""
    rng = np.random.default_rng(0)
    d, m = 9, 29
    W = rng.normal(size=(d, m))
    A = W.T @ W
    S = (A + 1e-3 * np.linalg.eigvalsh(A)[-1] * np.eye(m)) / d
    alpha = 1e-2 * np.trace(S) / m
    omega, solver, gap = solve_graphical_lasso(S, alpha)
    assert solver == "admm" and 0 <= gap <= 1e-8 * m
    assert np.isclose(graphical_lasso_gap(S, alpha, omega), gap, rtol=1e-6, atol=1e-12)
    assert np.linalg.eigvalsh(omega).min() > 0 and np.sum(omega == 0) > 0

    # any perturbation of the certified minimiser is no better
    def value(x):
        off = np.abs(x).sum() - np.abs(np.diag(x)).sum()
        return np.sum(S * x) - np.linalg.slogdet(x)[1] + alpha * off

    for _ in range(5):
        E = rng.normal(size=(m, m)) * 1e-3 * np.abs(omega).max()
        assert value(omega) <= value(omega + E + E.T) + gap + 1e-12


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=15, deadline=None)
@given(d=st.integers(1, 6), m=st.integers(1, 9), seed=st.integers(0, 10**6))
def test_sigma_prime_satisfies_inequality_28(name, d, m, seed):
    """gamma tr(U M U^T) <= sum_t sigma'_t M_tt |u_t|^2 for every mode and random U."""
    rng = np.random.default_rng(seed)
    gamma = float(rng.uniform(0.05, 1.0))
    f = build(name, m, rng, gamma=gamma)
    f.omega_step(random_models(rng, d, m))
    M = f.inverse_matrix()
    diag = np.diag(M)
    values = {mode: f.sigma_prime(mode) for mode in SIGMA_MODES}
    for mode, s in values.items():
        assert s.shape == (m,) and np.all(s >= gamma * (1 - 1e-12))
        for _ in range(20):
            U = rng.normal(size=(d, m)) * rng.exponential(size=m)
            lhs = gamma * np.trace(U @ M @ U.T)
            rhs = np.sum(s * diag * np.einsum("ij,ij->j", U, U))
            assert lhs <= rhs * (1 + 1e-10) + 1e-300, mode
    lemma9 = gamma * (np.abs(M).sum(axis=1) / diag).max()
    np.testing.assert_allclose(values["global"], lemma9, rtol=1e-14)
    assert np.all(values["spectral"] <= values["global"])
    assert np.all(values["per-task"] <= values["global"] * (1 + 1e-14))
    # the spectral value is tight: equality at the top eigenvector of D^-1/2 M D^-1/2
    C = M / np.sqrt(np.outer(diag, diag))
    top = np.linalg.eigh(C)[1][:, -1]
    U = np.zeros((d, m))
    U[0] = top / np.sqrt(diag)
    lhs = gamma * np.trace(U @ M @ U.T)
    rhs = np.sum(values["spectral"] * diag * U[0] ** 2)
    assert np.isclose(lhs, rhs, rtol=1e-9)


def test_sigma_prime_validates():
    M = np.array([[2.0, -1.0], [-1.0, 2.0]])
    np.testing.assert_allclose(sigma_prime(M, "global"), [1.5, 1.5])
    np.testing.assert_allclose(sigma_prime(M, "spectral"), [1.5, 1.5])  # lambda_max = 1.5
    np.testing.assert_allclose(sigma_prime(M, "per-task", gamma=0.5), [0.75, 0.75])
    with pytest.raises(ValueError, match="sigma-mode"):
        sigma_prime(M, "bogus")
    with pytest.raises(ValueError, match="gamma"):
        sigma_prime(M, gamma=1.5)
    with pytest.raises(ValueError, match="M"):
        sigma_prime(np.ones((2, 3)))


@pytest.mark.parametrize(
    "name, mode",
    [
        ("mean", "spectral"),
        ("clustered", "spectral"),
        ("graphical", "per-task"),
        ("probabilistic", "spectral"),
    ],
)
def test_sdca_rounds_with_these_sigma_primes_never_decrease_the_dual(name, mode):
    """(28) in use: W = B M, local SDCA with m_tt and sigma', D(alpha) monotone (Omega fixed)."""
    rng = np.random.default_rng(5)
    d, m = 6, 8
    tasks = []
    for _ in range(m):
        n = int(rng.integers(10, 40))
        X = rng.normal(size=(n, d))
        tasks.append(
            (X, np.where(X @ rng.normal(size=d) + 0.3 * rng.normal(size=n) > 0, 1.0, -1.0))
        )
    f = build(name, m, rng)
    f.omega_step(rng.normal(size=(d, m)))  # then Omega stays fixed
    M, m_diag, sp = f.inverse_matrix(), f.m_diag(), f.sigma_prime(mode)
    alphas = [np.zeros(len(y)) for _, y in tasks]
    B = np.zeros((d, m))

    def dual():
        return sum(
            y @ a / len(y) for (_, y), a in zip(tasks, alphas, strict=True)
        ) - 0.5 * np.trace(B @ M @ B.T)

    values = [dual()]
    for _ in range(15):
        W = B @ M
        delta = np.zeros((d, m))
        for t, (X, y) in enumerate(tasks):
            d_alpha, delta[:, t] = sdca_local_update(
                X,
                y,
                alphas[t],
                W[:, t].copy(),
                budget=len(y),
                m_tt=float(m_diag[t]),
                sigma_prime=float(sp[t]),
                order=rng.permutation(len(y)),
            )
            alphas[t] = alphas[t] + d_alpha
        B += delta
        values.append(dual())
    assert np.all(np.diff(values) >= -1e-12 * np.abs(values[1:]))
    assert values[-1] > values[0]


def test_make_formulation_validates_arguments_by_name():
    ok = {"lam": 1.0}
    cases = [
        (("nope", 3), ok, "formulation"),
        (("identity", 0), ok, "num_tasks"),
        (("identity", 3), {"lam": 0.0}, "lambda"),
        (("identity", 3), {"lam": math.inf}, "lambda"),
        (("identity", 3), {"lam": 1.0, "gamma": 0.0}, "gamma"),
        (("identity", 3), {"lam": 1.0, "eps_rel": -1.0}, "omega-eps"),
        (("mean", 3), ok, "lambda2"),
        (("mean", 3), {"lam": 1.0, "lam2": 0.0}, "lambda2"),
        (("probabilistic", 3), {"lam": 1.0, "s2": 0.0}, "s2"),
        (("clustered", 3), {"lam": 1.0, "k": 1}, "eta"),
        (("clustered", 3), {"lam": 1.0, "eta": 1.0}, "clusters"),
        (("clustered", 3), {"lam": 1.0, "eta": 1.0, "k": 4}, "clusters"),
        (("clustered", 3), {"lam": 1.0, "eta": -1.0, "k": 1}, "eta"),
        (("graphical", 3), {"lam": 1.0, "lam2": 0.1}, "s2"),
        (("graphical", 3), {"lam": 1.0, "lam2": 0.1, "s2": math.inf}, "s2"),
        (("graphical", 3), {"lam": 1.0, "s2": 1.0}, "lambda2"),
        (("graphical", 3), {"lam": 1.0, "lam2": -0.1, "s2": 1.0}, "lambda2"),
    ]
    for args, kwargs, word in cases:
        with pytest.raises(ValueError, match=word) as err:
            make_formulation(*args, **kwargs)
        assert "lam2" not in str(err.value) and "eps_rel" not in str(err.value)
    # lambda2 = 0 is a value where the formulation allows it
    assert make_formulation("graphical", 3, lam=1.0, lam2=0.0, s2=1.0).lam2 == 0.0
    # arguments a formulation does not use are ignored
    f = make_formulation("identity", 3, lam=1.0, lam2=5.0, s2=1.0, eta=1.0, k=2)
    assert f.fixed
    g = make_formulation("probabilistic", 3, lam=1.0, lam2=5.0, eta=1.0, k=2)
    assert math.isinf(g.s2)
    with pytest.raises(ValueError, match="W"):
        g.omega_step(np.zeros((2, 4)))
    with pytest.raises(ValueError, match="W"):
        g.objective(np.full((2, 3), np.nan))
    with pytest.raises(ValueError, match="positive definite"):
        GraphicalFormulation(2, lam=1.0, lam2=0.0, s2=1.0).set_omega(-np.eye(2))


def test_spectral_vs_lemma9_on_small_mat():
    """Measured ratio spectral / Lemma 9 sigma' for a probabilistic Sigma fitted on small.mat."""
    from fmtl_flower.centralized import fit_mocha
    from fmtl_flower.data import load_dataset

    try:
        data = load_dataset("small", seed=0, test_frac=0.0)
    except FileNotFoundError as err:
        pytest.skip(f"small not available: {err}")
    tasks = [(t.X_train, t.y_train) for t in data.tasks]
    assert (len(tasks), tasks[0][0].shape[1]) == (29, 9)
    fit = fit_mocha(tasks, lam=1e-4, rounds=300, omega="probabilistic", omega_every=10, seed=0)
    ratios = {}
    for eps_rel in (1e-3, 1e-7):  # the package default; the reference's tiny floor
        f = make_formulation("probabilistic", 29, lam=1e-4, eps_rel=eps_rel)
        f.omega_step(fit.W)
        ratios[eps_rel] = float(f.sigma_prime("spectral")[0] / f.sigma_prime("global")[0])
    message = "spectral / Lemma 9 sigma' on small.mat: " + ", ".join(
        f"eps_rel={e:g}: {r:.3f}" for e, r in ratios.items()
    )
    print(message)
    assert all(0.2 < r < 1.0 for r in ratios.values()), message
