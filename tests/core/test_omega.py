"""Omega-steps, sigma' (Lemma 9, Remark 5) and the objective's pieces."""

import numpy as np
import pytest
import scipy.linalg
from hypothesis import given, settings
from hypothesis import strategies as st

from fmtl_flower.core.formulations import make_formulation, sigma_prime
from fmtl_flower.core.mocha import MOCHAServerState
from fmtl_flower.core.objective import primal_dual_gap
from fmtl_flower.core.omega import sigma_identity, sigma_probabilistic


def test_probabilistic_matches_sqrtm_full_rank():
    rng = np.random.default_rng(0)
    W = rng.normal(size=(12, 5))
    root = scipy.linalg.sqrtm(W.T @ W).real
    expected = root / np.trace(root)
    np.testing.assert_allclose(sigma_probabilistic(W, eps_rel=1e-14), expected, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 10**6))
def test_probabilistic_is_spd_unit_trace_and_minimises(d, m, seed):
    rng = np.random.default_rng(seed)
    W = rng.normal(size=(d, m))
    sigma = sigma_probabilistic(W)
    assert np.allclose(sigma, sigma.T)
    assert np.isclose(np.trace(sigma), 1.0)
    assert np.linalg.eigvalsh(sigma).min() > 0  # positive definite even when m > d
    # Sigma minimises the perturbed objective it is the exact solution of,
    # tr(Sigma^-1 (W^T W + eps I)) with eps = eps_rel lambda_max(W^T W), over unit-trace SPD
    # Sigma. (Not the unperturbed tr(W Sigma^-1 W^T): for a near-singular W^T W the eps
    # perturbation costs up to ~0.1 % there, e.g. d = m = 2, seed 1024.)
    gram = W.T @ W
    eps = 1e-3 * np.linalg.eigvalsh(gram).max()
    perturbed = gram + eps * np.eye(m)
    best = np.trace(np.linalg.solve(sigma, perturbed))
    for _ in range(5):
        A = rng.normal(size=(m, m))
        other = A @ A.T + 1e-3 * np.eye(m)
        other /= np.trace(other)
        assert best <= np.trace(np.linalg.solve(other, perturbed)) * (1 + 1e-9)


def test_zero_models_give_identity():
    np.testing.assert_allclose(sigma_probabilistic(np.zeros((3, 4))), np.eye(4) / 4)
    with pytest.raises(ValueError, match="omega|formulation|nope"):
        make_formulation("nope", 4, lam=1.0)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.integers(1, 5), st.integers(0, 10**6),
       st.sampled_from(["global", "per-task"]))
def test_sigma_prime_satisfies_inequality_28(m, d, seed, mode):
    """gamma |X alpha|_M^2 <= sum_t sigma'_t M_tt |X_t alpha_t|^2 for any alpha (gamma = 1)."""
    rng = np.random.default_rng(seed)
    sigma = sigma_probabilistic(rng.normal(size=(d + 2, m)))
    s = sigma_prime(sigma, mode)
    for _ in range(20):
        U = rng.normal(size=(d, m))  # columns u_t = X_t alpha_t
        lhs = np.trace(U @ sigma @ U.T)
        rhs = np.sum(s * np.diag(sigma) * np.einsum("ij,ij->j", U, U))
        assert lhs <= rhs * (1 + 1e-10) + 1e-14
    assert np.all(s >= 1.0 - 1e-12)
    assert np.all(sigma_prime(sigma, "per-task") <= sigma_prime(sigma, "global") + 1e-12)


def test_sigma_prime_identity_is_one_and_validates():
    np.testing.assert_allclose(sigma_prime(sigma_identity(5)), np.ones(5))
    with pytest.raises(ValueError, match="gamma"):
        sigma_prime(sigma_identity(3), gamma=0.0)
    with pytest.raises(ValueError, match="sigma-mode"):
        sigma_prime(sigma_identity(3), "bogus")


def test_server_state_keeps_w_equal_to_b_sigma_over_lambda():
    rng = np.random.default_rng(1)
    state = MOCHAServerState.zeros_for(4, 6, "probabilistic", lam=0.5)
    state.add_updates(np.array([0, 3]), rng.normal(size=(4, 2)))
    state.add_updates(np.array([1, 2, 3, 4, 5]), rng.normal(size=(4, 5)))
    np.testing.assert_allclose(state.W, state.B @ (np.eye(6) / 6) / 0.5, atol=1e-14)
    state.omega_step()
    sigma = state.formulation.omega  # the probabilistic formulation's Sigma
    np.testing.assert_allclose(state.W, state.B @ sigma / 0.5, atol=1e-14)
    state.add_updates(np.array([2]), rng.normal(size=(4, 1)))
    state.reset_tasks(np.array([2, 4]))
    assert not state.B[:, [2, 4]].any()
    np.testing.assert_allclose(state.W, state.B @ sigma / 0.5, atol=1e-13)
    np.testing.assert_allclose(state.m_diag(), np.diag(sigma) / 0.5)
    with pytest.raises(ValueError, match="lam"):
        MOCHAServerState.zeros_for(2, 2, lam=0.0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(2, 6), st.integers(0, 10**6))
def test_weak_duality_for_consistent_pairs(d, m, seed):
    """P(W(alpha)) - D(alpha) >= 0 for any feasible alpha and any Sigma."""
    rng = np.random.default_rng(seed)
    lam = 10.0 ** rng.uniform(-4, 1)
    tasks, B = [], np.zeros((d, m))
    alphas = []
    for t in range(m):
        n = rng.integers(1, 10)
        X, y = rng.normal(size=(n, d)), rng.choice([-1.0, 1.0], size=n)
        alpha = y * rng.uniform(0, 1, size=n)
        tasks.append((X, y))
        alphas.append(alpha)
        B[:, t] = X.T @ alpha / n
    formulation = make_formulation("probabilistic", m, lam=lam)
    formulation.set_omega(sigma_probabilistic(rng.normal(size=(d, m))))
    state = MOCHAServerState(B=B, formulation=formulation)
    loss = np.array([np.maximum(0, 1 - y * (X @ state.W[:, t])).mean()
                     for t, (X, y) in enumerate(tasks)])
    dual = np.array([y @ a / len(y) for (_, y), a in zip(tasks, alphas, strict=True)])
    primal, dual_value, gap = primal_dual_gap(loss, dual, state.W, state.B)
    assert gap >= -1e-12 * max(1.0, abs(primal))
    # the quadratic term equals (1/2) tr(W K W^T) with K = lam * Sigma^-1
    K = lam * np.linalg.inv(formulation.omega)
    assert np.isclose(0.5 * np.trace(state.W @ K @ state.W.T), state.regulariser(),
                      rtol=1e-6, atol=1e-12)
