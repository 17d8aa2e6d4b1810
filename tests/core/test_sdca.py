"""The compiled SDCA local solver against a plain-numpy reference and its invariants."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmtl_flower.core.rng import coordinate_order
from fmtl_flower.core.sdca import sdca_local_update


def reference_sdca(X, y, alpha, w, budget, m_tt, sigma_p, order):
    """The per-sample loop of the MOCHA reference (section 2.3), in plain numpy."""
    n = X.shape[0]
    d_alpha = np.zeros(n)
    d_b = np.zeros(X.shape[1])
    for s in range(budget):
        i = order[s % n]
        x = X[i]
        xx = x @ x
        if xx == 0:
            continue
        v = w + sigma_p * m_tt * d_b
        a_old = y[i] * (alpha[i] + d_alpha[i])
        q = sigma_p * m_tt * xx / n
        a_new = np.clip(a_old + (1 - y[i] * (x @ v)) / q, 0, 1)
        delta = y[i] * (a_new - a_old)
        d_alpha[i] += delta
        d_b += delta * x / n
    return d_alpha, d_b


def subproblem(X, y, alpha, w, d_alpha, m_tt, sigma_p):
    """G(d_alpha) - G(0) of the local subproblem (MOCHA eq. (4))."""
    n = X.shape[0]
    d_b = X.T @ d_alpha / n
    return y @ d_alpha / n - w @ d_b - 0.5 * sigma_p * m_tt * d_b @ d_b


@st.composite
def problems(draw):
    n = draw(st.integers(1, 25))
    d = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)) * draw(st.sampled_from([0.01, 1.0, 30.0]))
    if draw(st.booleans()):
        X[rng.integers(n)] = 0.0  # a zero-norm row
    y = rng.choice([-1.0, 1.0], size=n)
    alpha = y * rng.uniform(0, 1, size=n) * draw(st.sampled_from([0.0, 1.0]))
    w = rng.normal(size=d) * draw(st.sampled_from([0.0, 0.1, 10.0]))
    budget = draw(st.integers(0, 3 * n))
    m_tt = draw(st.sampled_from([1e-3, 1.0, 345.0, 1e5]))
    sigma_p = draw(st.sampled_from([1.0, 2.5, 29.0]))
    return X, y, alpha, w, budget, m_tt, sigma_p, coordinate_order(seed, 0, 1, n)


@settings(max_examples=150, deadline=None)
@given(problems())
def test_matches_reference_and_keeps_invariants(problem):
    X, y, alpha, w, budget, m_tt, sigma_p, order = problem
    d_alpha, d_b = sdca_local_update(X, y, alpha, w, budget=budget, m_tt=m_tt,
                                     sigma_prime=sigma_p, order=order)
    ref_alpha, ref_b = reference_sdca(X, y, alpha, w, budget, m_tt, sigma_p, order)
    np.testing.assert_allclose(d_alpha, ref_alpha, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(d_b, ref_b, rtol=1e-9, atol=1e-12)
    a = y * (alpha + d_alpha)
    assert np.all(a >= -1e-15) and np.all(a <= 1 + 1e-15)  # dual feasibility
    np.testing.assert_allclose(d_b, X.T @ d_alpha / X.shape[0], atol=1e-15)
    zero_rows = np.einsum("ij,ij->i", X, X) == 0
    assert np.all(d_alpha[zero_rows] == 0)  # skipped, not divided by
    # each step maximises the subproblem exactly, so it never decreases
    assert subproblem(X, y, alpha, w, d_alpha, m_tt, sigma_p) >= -1e-12


def test_budget_zero_and_errors():
    X = np.ones((3, 2))
    y = np.array([1.0, -1.0, 1.0])
    d_alpha, d_b = sdca_local_update(X, y, np.zeros(3), np.zeros(2), budget=0, m_tt=1.0,
                                     sigma_prime=1.0, order=np.arange(3))
    assert not d_alpha.any() and not d_b.any()
    with pytest.raises(ValueError, match="m_tt"):
        sdca_local_update(X, y, np.zeros(3), np.zeros(2), budget=1, m_tt=0.0,
                          sigma_prime=1.0, order=np.arange(3))
    with pytest.raises(ValueError, match="budget"):
        sdca_local_update(X, y, np.zeros(3), np.zeros(2), budget=-1, m_tt=1.0,
                          sigma_prime=1.0, order=np.arange(3))
    with pytest.raises(ValueError, match="order"):
        sdca_local_update(X, y, np.zeros(3), np.zeros(2), budget=1, m_tt=1.0,
                          sigma_prime=1.0, order=np.arange(2))


def test_coordinate_order_is_a_seeded_permutation():
    p = coordinate_order(5, 3, 7, 40)
    assert sorted(p) == list(range(40))
    np.testing.assert_array_equal(p, coordinate_order(5, 3, 7, 40))
    assert not np.array_equal(p, coordinate_order(5, 3, 8, 40))
    assert not np.array_equal(p, coordinate_order(5, 4, 7, 40))
    assert not np.array_equal(p, coordinate_order(6, 3, 7, 40))
    # first position is uniform over 0..4 (chi-square, 4 dof, p = 1e-4 -> 23.5)
    counts = np.bincount([coordinate_order(0, 0, r, 5)[0] for r in range(5000)], minlength=5)
    assert ((counts - 1000) ** 2 / 1000).sum() < 23.5
