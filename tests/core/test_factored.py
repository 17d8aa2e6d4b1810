"""Factored task matrices (core/factored.py, core/mocha_factored.py) against the dense path."""

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmtl_flower.core.decoupling import coupling_weights
from fmtl_flower.core.factored import (
    DENSE_MATERIALISE_MAX_TASKS,
    FactoredMatrix,
    gram_eigen,
    make_factored_formulation,
    sigma_prime_factored,
    sigma_probabilistic_factored,
)
from fmtl_flower.core.formulations import SIGMA_MODES, make_formulation, sigma_prime
from fmtl_flower.core.mocha import MOCHAServerState
from fmtl_flower.core.mocha_factored import (
    FACTORED_MIN_TASKS,
    GRAPHICAL_MAX_TASKS,
    FactoredMOCHAServerState,
    choose_server_path,
    make_server_state,
    restore_server_state,
)
from fmtl_flower.core.omega import sigma_probabilistic

from .numerics import assert_close as close_to

RTOL = 1e-10
FACTORED_NAMES = ("identity", "mean", "probabilistic", "clustered")

# (d, m, rank or None): m < d, m = d, m > d, rank-deficient, one column 0, m = 2000
SIZES = [(30, 10, None), (20, 20, None), (12, 12, 4), (10, 300, None), (40, 500, 5), (8, 64, None)]
LARGE = (100, 2000)  # the dense path still fits: one case per quantity (seconds each)


def assert_close(actual, expected, rtol=RTOL):
    """:func:`tests.core.numerics.assert_close` with this module's default tolerance."""
    close_to(actual, expected, rtol)


def models(d, m, rank=None, seed=0, zero_column=False):
    rng = np.random.default_rng(seed)
    if rank is None:
        W = rng.normal(size=(d, m))
    else:
        W = rng.normal(size=(d, rank)) @ rng.normal(size=(rank, m))
    W *= rng.lognormal(0.0, 1.0, size=m)  # unequal task norms: a non-constant m_tt
    if zero_column:
        W[:, 1] = 0.0
    return W


def options(name, m, rng):
    opts = {"lam": 10.0 ** rng.uniform(-3, 0), "gamma": float(rng.choice([1.0, 0.5]))}
    if name == "mean":
        opts["lam2"] = 10.0 ** rng.uniform(-3, 0)
    elif name == "probabilistic":
        opts["s2"] = [None, math.inf, 10.0 ** rng.uniform(-1, 2)][rng.integers(3)]
        opts["eps_rel"] = float(rng.choice([1e-3, 1e-2]))
    elif name == "clustered":
        opts["eta"] = 10.0 ** rng.uniform(-2, 1)
        opts["k"] = float(rng.uniform(0.5, min(m, 8)))
    return opts


def random_factor(m, r, rng, c=None, negative=False):
    V = np.linalg.qr(rng.normal(size=(m, r)))[0] if r else np.zeros((m, 0))
    s = rng.uniform(0.01, 2.0, size=r)
    if negative:
        s[: r // 2] *= -0.5
    return FactoredMatrix(V, s, rng.uniform(0.1, 1.0) if c is None else c)


# ----------------------------------------------------------------------------- FactoredMatrix


@pytest.mark.parametrize("m,r", [(1, 0), (1, 1), (7, 0), (7, 1), (7, 7), (50, 3), (300, 12)])
def test_factored_matrix_algebra_matches_dense(m, r):
    rng = np.random.default_rng(m * 100 + r)
    A = random_factor(m, r, rng)
    dense = A.dense()
    np.testing.assert_array_equal(dense, dense.T)
    assert_close(A.diag(), np.diag(dense))
    assert math.isclose(A.trace(), np.trace(dense), rel_tol=1e-12)
    assert_close(A.inverse().dense(), np.linalg.inv(dense))
    assert_close(A.apply(np.sqrt).dense() @ A.apply(np.sqrt).dense(), dense)
    assert_close(A.scale(3.0).dense(), 3.0 * dense)
    B = rng.normal(size=(5, m))
    assert_close(A.right_multiply(B), B @ dense)
    tasks = rng.permutation(m)[: max(1, m // 3)]
    dB = rng.normal(size=(5, len(tasks)))
    assert_close(A.rows_product(dB, tasks), dB @ dense[tasks, :])
    assert math.isclose(A.quad_trace(B), np.trace(B @ dense @ B.T), rel_tol=1e-10)
    evals = np.linalg.eigvalsh(dense)
    assert math.isclose(A.min_eigenvalue(), evals[0], rel_tol=1e-10)
    assert math.isclose(A.max_eigenvalue(), evals[-1], rel_tol=1e-10)
    A.check()


@pytest.mark.parametrize("negative", [False, True])
@pytest.mark.parametrize("tile", [1, 7, 64, 1024])
def test_abs_row_sums_blocked_symmetric(tile, negative):
    rng = np.random.default_rng(tile)
    for m, r in [(1, 1), (5, 1), (130, 1), (130, 2), (130, 9), (257, 30)]:
        A = random_factor(m, r, rng, negative=negative)
        assert_close(A.abs_row_sums(tile=tile), np.abs(A.dense()).sum(axis=1), rtol=1e-12)


@pytest.mark.parametrize("method", ["secular", "lanczos", "dense"])
def test_scaled_top_eigenvalue_methods(method):
    rng = np.random.default_rng(3)
    for m, r in [(5, 1), (80, 1), (80, 4), (300, 40), (300, 300)]:
        A = random_factor(m, r, rng)
        D = np.diag(A.dense())
        C = A.dense() / np.sqrt(np.outer(D, D))
        expected = np.linalg.eigvalsh(C)[-1]
        assert math.isclose(A.scaled_top_eigenvalue(method=method), expected, rel_tol=1e-10)


def test_scaled_top_eigenvalue_with_negative_weights_uses_lanczos():
    A = random_factor(120, 10, np.random.default_rng(4), negative=True)
    D = np.diag(A.dense())
    expected = np.linalg.eigvalsh(A.dense() / np.sqrt(np.outer(D, D)))[-1]
    assert math.isclose(A.scaled_top_eigenvalue(), expected, rel_tol=1e-10)
    with pytest.raises(ValueError, match="s >= 0"):
        A.scaled_top_eigenvalue(method="secular")


def test_secular_with_vanishing_rows_and_constant_diagonal():
    rng = np.random.default_rng(5)
    V = np.zeros((200, 3))
    V[:50] = np.linalg.qr(rng.normal(size=(50, 3)))[0]  # tasks 50.. outside span(V)
    for c in (1e-3, 1.0, 1e3):
        A = FactoredMatrix(V, np.array([1.0, 0.5, 0.25]), c)
        D = np.diag(A.dense())
        expected = np.linalg.eigvalsh(A.dense() / np.sqrt(np.outer(D, D)))[-1]
        assert math.isclose(A.scaled_top_eigenvalue(method="secular"), expected, rel_tol=1e-10)
    mean = make_factored_formulation("mean", 500, lam=0.3, lam2=0.01).inverse_factor()
    D = mean.diag()
    assert math.isclose(mean.scaled_top_eigenvalue(), (mean.c + mean.s[0]) / D[0], rel_tol=1e-12)


def test_factored_matrix_validates():
    with pytest.raises(ValueError, match="V must be"):
        FactoredMatrix(np.zeros((3, 2)), np.zeros(3), 1.0)
    with pytest.raises(ValueError, match="finite"):
        FactoredMatrix(np.zeros((3, 1)), np.array([np.nan]), 1.0)
    with pytest.raises(ValueError, match="singular"):
        FactoredMatrix.scaled_identity(4, 0.0).inverse()
    with pytest.raises(ValueError, match="orthonormal"):
        FactoredMatrix(np.ones((4, 2)), np.ones(2), 1.0).check()
    with pytest.raises(ValueError, match="unknown sigma-mode"):
        sigma_prime_factored(FactoredMatrix.scaled_identity(3, 1.0), "max")


# ----------------------------------------------------------------------------- Omega-step


@pytest.mark.parametrize("d,m,rank", [*SIZES, (*LARGE, None)])
def test_gram_eigen_is_orthonormal_and_matches_the_gram_spectrum(d, m, rank):
    W = models(d, m, rank)
    mu, V = gram_eigen(W)
    assert mu.shape == (min(d, m),) and np.all(np.diff(mu) <= 0) and mu[-1] >= 0
    FactoredMatrix(V, np.ones(V.shape[1]), 0.0).check(atol=1e-12)
    evals = np.clip(np.linalg.eigvalsh(W.T @ W), 0, None)[::-1][: mu.size]
    assert_close(mu, evals, rtol=1e-12)
    r = V.shape[1]
    assert r == (min(d, m) if rank is None or m <= d else rank)
    gram_V = W.T @ (W @ V)  # (W^T W) V = V diag(mu)
    assert_close(gram_V, V * mu[:r], rtol=1e-10)


@pytest.mark.parametrize("eps_rel", [1e-3, 1e-1])
@pytest.mark.parametrize("d,m,rank", SIZES)
def test_probabilistic_step_matches_dense(d, m, rank, eps_rel):
    W = models(d, m, rank, seed=d + m, zero_column=m > 2)
    dense = sigma_probabilistic(W, eps_rel)
    factor = sigma_probabilistic_factored(W, eps_rel)
    assert factor.rank <= min(d, m) and factor.c > 0 and np.all(factor.s >= 0)
    assert math.isclose(factor.trace(), 1.0, rel_tol=1e-12)
    assert_close(factor.dense(), dense)
    assert_close(factor.diag(), np.diag(dense))
    for mode in SIGMA_MODES:
        assert_close(sigma_prime_factored(factor, mode), sigma_prime(dense, mode))


def test_probabilistic_step_of_zero_models_is_the_start():
    factor = sigma_probabilistic_factored(np.zeros((3, 50)))
    assert factor.rank == 0 and factor.c == 1.0 / 50
    with pytest.raises(ValueError, match="eps_rel"):
        sigma_probabilistic_factored(np.ones((2, 3)), 0.0)


# ----------------------------------------------------------------------------- formulations


def compare_formulations(fac, den, W, rtol=RTOL):
    assert fac.fixed == den.fixed and fac.name == den.name
    assert_close(fac.inverse_matrix(), den.inverse_matrix(), rtol)
    assert_close(fac.regulariser_matrix(), den.regulariser_matrix(), rtol)
    assert_close(fac.m_diag(), den.m_diag(), rtol)
    for mode in SIGMA_MODES:
        assert_close(fac.sigma_prime(mode), den.sigma_prime(mode), rtol)
    assert_close(fac.objective(W), den.objective(W), rtol)
    assert_close(fac.step_objective(W), den.step_objective(W), rtol)
    if hasattr(den, "omega"):
        assert_close(fac.omega, den.omega, rtol)
    if hasattr(den, "omega_eigenvalues"):
        assert_close(fac.omega_eigenvalues, den.omega_eigenvalues, rtol)


@pytest.mark.parametrize("name", FACTORED_NAMES)
@pytest.mark.parametrize("d,m,rank", SIZES)
def test_formulation_matches_dense_before_and_after_omega_steps(name, d, m, rank):
    rng = np.random.default_rng(hash((name, d, m)) % 2**32)
    opts = options(name, m, rng)
    fac, den = make_factored_formulation(name, m, **opts), make_formulation(name, m, **opts)
    W = models(d, m, rank, seed=int(rng.integers(1 << 30)))
    compare_formulations(fac, den, W)
    for step in range(2):
        fac.omega_step(W)
        den.omega_step(W)
        compare_formulations(fac, den, W)
        W = W + 0.1 * models(d, m, rank, seed=step)


@pytest.mark.parametrize("name", ["probabilistic", "clustered"])
def test_large_m_matches_dense(name):
    d, m = LARGE
    rng = np.random.default_rng(11)
    opts = options(name, m, rng)
    fac, den = make_factored_formulation(name, m, **opts), make_formulation(name, m, **opts)
    W = models(d, m, seed=12)
    fac.omega_step(W)
    den.omega_step(W)
    assert_close(fac.inverse_matrix(), den.inverse_matrix())
    assert_close(fac.m_diag(), den.m_diag())
    for mode in SIGMA_MODES:
        assert_close(fac.sigma_prime(mode), den.sigma_prime(mode))
    assert_close(fac.objective(W), den.objective(W))
    if name == "probabilistic":
        assert_close(fac.sigma_factor.dense(), sigma_probabilistic(W, fac.eps_rel))


def test_clustered_with_fewer_directions_than_clusters():
    # rank 2 < k = 5: q = 1 on span(W^T), (k - 2) / (m - 2) on the rest
    W = models(6, 40, rank=2, seed=9)
    fac = make_factored_formulation("clustered", 40, lam=0.1, eta=0.5, k=5.0)
    den = make_formulation("clustered", 40, lam=0.1, eta=0.5, k=5.0)
    fac.omega_step(W)
    den.omega_step(W)
    compare_formulations(fac, den, W)
    assert fac.omega_factor.rank == 2 and math.isclose(fac.omega_factor.c, 3 / 38)


def test_make_factored_formulation_validates():
    with pytest.raises(ValueError, match="graphical"):
        make_factored_formulation("graphical", 10, lam=0.1, lam2=0.0, s2=1.0)
    with pytest.raises(ValueError, match="unknown omega"):
        make_factored_formulation("nope", 10, lam=0.1)
    with pytest.raises(ValueError, match="lambda2"):
        make_factored_formulation("mean", 10, lam=0.1)
    with pytest.raises(ValueError, match="clusters must be"):
        make_factored_formulation("clustered", 10, lam=0.1, eta=1.0, k=11)
    with pytest.raises(ValueError, match="num_tasks"):
        make_factored_formulation("identity", 0, lam=0.1)
    f = make_factored_formulation("probabilistic", 10, lam=0.1)
    with pytest.raises(ValueError, match="unit trace"):
        f.set_omega(FactoredMatrix.scaled_identity(10, 1.0))
    with pytest.raises(ValueError, match="FactoredMatrix"):
        f.set_omega(np.eye(10) / 10)


# ----------------------------------------------------------------------------- server state


def drive(state, rng, rounds=6):
    """Random W-steps, resets and Omega-steps; returns after the last one."""
    d, m = state.B.shape
    for r in range(rounds):
        tasks = rng.permutation(m)[: max(1, int(0.7 * m))]
        state.add_updates(tasks, rng.normal(size=(d, len(tasks))) * 0.1)
        if r == 2:
            state.reset_tasks(rng.permutation(m)[:2])
        if r % 2 == 1:
            state.omega_step()


@pytest.mark.parametrize("name", FACTORED_NAMES)
@pytest.mark.parametrize("d,m", [(6, 4), (5, 60), (20, 800)])
def test_server_state_matches_dense(name, d, m):
    rng = np.random.default_rng(m)
    opts = options(name, m, rng)
    fac = FactoredMOCHAServerState.zeros_for(d, m, name, **opts)
    den = MOCHAServerState.zeros_for(d, m, name, **opts)
    drive(fac, np.random.default_rng(1))
    drive(den, np.random.default_rng(1))
    np.testing.assert_array_equal(fac.B, den.B)
    assert_close(fac.W, den.W)
    assert_close(fac.W, fac.M.right_multiply(fac.B))  # incremental W == B M
    assert_close(fac.m_diag(), den.m_diag())
    for mode in SIGMA_MODES:
        assert_close(fac.sigma_prime(mode), den.sigma_prime(mode))
    assert_close(fac.regulariser(), den.regulariser())
    assert_close(fac.regulariser(), 0.5 * fac.formulation.regulariser_factor().quad_trace(fac.W))
    assert (fac.lam, fac.num_tasks, fac.dim) == (den.lam, den.num_tasks, den.dim)


@pytest.mark.parametrize("name", FACTORED_NAMES)
@pytest.mark.parametrize("d,m", [(6, 4), (5, 60)])
def test_a_decoupled_server_state_matches_dense(name, d, m):
    """Robust mode's decoupling on the factored path: the same M' (hence W, m_tt, sigma'
    and coupling weights) as the dense path's, now and after later Omega-steps, and kept
    through a checkpoint."""
    rng = np.random.default_rng(m)
    opts = options(name, m, rng)
    fac = FactoredMOCHAServerState.zeros_for(d, m, name, **opts)
    den = MOCHAServerState.zeros_for(d, m, name, **opts)
    drive(fac, np.random.default_rng(1), rounds=3)
    drive(den, np.random.default_rng(1), rounds=3)
    mask = np.isin(np.arange(m), [1, m - 1])
    fac.decouple(mask)
    den.decouple(mask)
    np.testing.assert_allclose(fac.W, den.W, rtol=0, atol=1e-10)
    np.testing.assert_allclose(fac.M.dense(), den.M, rtol=0, atol=1e-12 * np.abs(den.M).max())
    drive(fac, np.random.default_rng(2))
    drive(den, np.random.default_rng(2))
    np.testing.assert_allclose(fac.W, den.W, rtol=0, atol=1e-10)
    np.testing.assert_allclose(fac.M.dense(), den.M, rtol=0, atol=1e-12 * np.abs(den.M).max())
    assert_close(fac.W, fac.M.right_multiply(fac.B))
    assert_close(fac.m_diag(), den.m_diag())
    for mode in SIGMA_MODES:
        assert_close(fac.sigma_prime(mode), den.sigma_prime(mode))
    scale = np.abs(den.M).max()
    np.testing.assert_allclose(fac.coupling_weights(), coupling_weights(den.M), rtol=0,
                               atol=1e-12 * m * scale)
    assert np.all(fac.coupling_weights()[mask] <= 1e-12 * m * scale)
    restored = restore_server_state(fac.state_arrays(), m, name, **opts)
    restored.decoupled = mask.copy()
    for state in (restored, fac, den):
        state.omega_step()
    np.testing.assert_array_equal(restored.W, fac.W)
    np.testing.assert_allclose(fac.W, den.W, rtol=0, atol=1e-10)


def test_server_state_caches_until_the_omega_step():
    state = FactoredMOCHAServerState.zeros_for(3, 30, "probabilistic", lam=0.1)
    drive(state, np.random.default_rng(2), rounds=2)
    first = state.sigma_prime("per-task")
    first[:] = -1.0  # callers get copies
    assert state._sigma["per-task"].min() > 0
    diag = state.m_diag()
    state.add_updates(np.arange(30), np.ones((3, 30)))
    assert state._sigma and np.array_equal(state.m_diag(), diag)  # a W-step keeps them
    state.omega_step()
    assert not state._sigma and state._m_diag is None


@pytest.mark.parametrize("name", FACTORED_NAMES)
def test_state_arrays_round_trip(name):
    rng = np.random.default_rng(7)
    opts = options(name, 40, rng)
    state = FactoredMOCHAServerState.zeros_for(4, 40, name, **opts)
    drive(state, rng)
    arrays = {k: np.array(v, copy=True) for k, v in state.state_arrays().items()}
    back = restore_server_state(arrays, 40, name, **opts)
    assert isinstance(back, FactoredMOCHAServerState)
    np.testing.assert_array_equal(back.W, state.W)
    np.testing.assert_array_equal(back.M.V, state.M.V)
    np.testing.assert_array_equal(back.sigma_prime("spectral"), state.sigma_prime("spectral"))
    tasks, dB = np.arange(0, 40, 3), rng.normal(size=(4, 14))
    back.add_updates(tasks, dB)
    state.add_updates(tasks, dB)
    back.omega_step()
    state.omega_step()
    np.testing.assert_array_equal(back.W, state.W)
    broken = dict(arrays)
    del broken["M.s"]
    with pytest.raises(ValueError, match="lacks"):
        restore_server_state(broken, 40, name, **opts)


def test_restore_server_state_reads_the_dense_kind_too():
    dense = MOCHAServerState.zeros_for(3, 8, "probabilistic", lam=0.1)
    drive(dense, np.random.default_rng(3))
    back = restore_server_state(dense.state_arrays(), 8, "probabilistic", lam=0.1)
    assert isinstance(back, MOCHAServerState)
    np.testing.assert_array_equal(back.W, dense.W)


# ----------------------------------------------------------------------------- path choice


def test_choose_server_path():
    big = FACTORED_MIN_TASKS + 1
    assert choose_server_path(FACTORED_MIN_TASKS, 10, "probabilistic") == "dense"
    assert choose_server_path(big, 10, "probabilistic") == "factored"
    assert choose_server_path(big, (big + 1) // 2, "probabilistic") == "dense"  # m <= 2 d
    assert choose_server_path(DENSE_MATERIALISE_MAX_TASKS + 1, 10**5, "mean") == "factored"
    assert choose_server_path(5, 100, "clustered", "factored") == "factored"
    assert choose_server_path(10**5, 100, "identity", "auto") == "factored"
    assert choose_server_path(big, 10, "graphical") == "dense"
    with pytest.raises(ValueError, match=f"up to {GRAPHICAL_MAX_TASKS} tasks"):
        choose_server_path(GRAPHICAL_MAX_TASKS + 1, 10, "graphical")
    with pytest.raises(ValueError, match="no factored form"):
        choose_server_path(10, 10, "graphical", "factored")
    with pytest.raises(ValueError, match="path must be"):
        choose_server_path(10, 10, "identity", "sparse")
    with pytest.raises(ValueError, match="omega must be"):
        choose_server_path(10, 10, "nope")
    with pytest.raises(ValueError, match="use 'factored'"):
        choose_server_path(DENSE_MATERIALISE_MAX_TASKS + 1, 10, "identity", "dense")
    assert isinstance(make_server_state(3, 10, "identity", lam=0.1), MOCHAServerState)
    state = make_server_state(3, big, "probabilistic", lam=0.1)
    assert isinstance(state, FactoredMOCHAServerState) and state.W.shape == (3, big)


def test_large_m_never_forms_an_m_by_m_matrix():
    """m = 20 000, d = 5: an m x m float64 matrix would be 3.2 GB."""
    m, d = 20_000, 5
    state = make_server_state(d, m, "probabilistic", lam=0.1, path="factored")
    rng = np.random.default_rng(0)
    tracemalloc.start()
    try:
        state.add_updates(np.arange(m), rng.normal(size=(d, m)))
        state.omega_step()
        sig = {mode: state.sigma_prime(mode) for mode in SIGMA_MODES}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"peak {peak / 2**20:.0f} MB"
    assert state.M.rank == d
    assert 1.0 <= sig["spectral"][0] <= sig["global"][0] * (1 + 1e-12)
    assert np.all(sig["per-task"] <= sig["global"][0])
    with pytest.raises(ValueError, match="forms dense matrices only up to"):
        make_factored_formulation(
            "identity", DENSE_MATERIALISE_MAX_TASKS + 1, lam=1.0
        ).inverse_matrix()


# ----------------------------------------------------------------------------- properties


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 40), st.integers(0, 8), st.integers(0, 10**6))
def test_property_probabilistic_factored_equals_dense(d, m, rank, seed):
    W = models(d, m, rank if 0 < rank < min(d, m) else None, seed=seed)
    dense = sigma_probabilistic(W)
    factor = sigma_probabilistic_factored(W)
    factor.check(atol=1e-12)
    assert_close(factor.dense(), dense)
    assert_close(factor.inverse().dense(), np.linalg.inv(dense), rtol=1e-9)
    for mode in SIGMA_MODES:
        assert_close(sigma_prime_factored(factor, mode), sigma_prime(dense, mode))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 60), st.integers(0, 12), st.integers(0, 10**6))
def test_property_sigma_prime_order_and_inequality_28(m, r, seed):
    rng = np.random.default_rng(seed)
    A = random_factor(m, min(r, m), rng)
    spectral = sigma_prime_factored(A, "spectral")[0]
    per_task = sigma_prime_factored(A, "per-task")
    glob = sigma_prime_factored(A, "global")[0]
    assert 1.0 - 1e-12 <= spectral <= glob * (1 + 1e-12)
    assert math.isclose(per_task.max(), glob, rel_tol=1e-14)
    # (28): sum_tt' M_tt' <u_t, u_t'> <= sigma' sum_t M_tt |u_t|^2 for random u
    M, D = A.dense(), A.diag()
    for _ in range(5):
        U = rng.normal(size=(m, 3))
        lhs = float(np.einsum("ij,ik,jk->", M, U, U))
        assert lhs <= spectral * float((D * (U * U).sum(axis=1)).sum()) * (1 + 1e-10) + 1e-12
