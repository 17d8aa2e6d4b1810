"""The SDCA local solvers: the compiled kernel against a plain-numpy reference and its
invariants, the zero-norm-row rule of every dual kernel (the gap closes), and the numpy
implementations (used without numba) against the compiled kernels."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmtl_flower.core import jit
from fmtl_flower.core.jit import numba_available
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
        a_old = y[i] * (alpha[i] + d_alpha[i])
        if xx == 0:  # the coordinate's exact maximiser: y_i a_i = 1
            d_alpha[i] += y[i] * (1 - a_old)
            continue
        v = w + sigma_p * m_tt * d_b
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
    visited = np.zeros(X.shape[0], dtype=bool)
    visited[order[:budget]] = True
    assert np.all(a[zero_rows & visited] == 1.0)  # set to their maximiser, not divided by
    assert np.all(d_alpha[zero_rows & ~visited] == 0)
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


# -- zero-norm rows: one rule in every dual kernel, so the duality gap closes ------------------


def _zero_row_task(n=12, d=3, zeros=(2, 7), seed=4):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    X[list(zeros)] = 0.0
    y = rng.choice([-1.0, 1.0], size=n)
    return X, y


def _single_task_gap(X, y, alpha, m_tt):
    """Primal minus dual of one task with regulariser |w|^2 / (2 m_tt), w = m_tt X^T alpha / n
    (MOCHA's problem for T = 1, K = 1 / m_tt)."""
    n = X.shape[0]
    b = X.T @ alpha / n
    w = m_tt * b
    primal = np.maximum(0.0, 1.0 - y * (X @ w)).mean() + 0.5 * w @ w / m_tt
    dual = y @ alpha / n - 0.5 * m_tt * b @ b
    return primal - dual, w


@pytest.mark.parametrize("solver", ["mocha", "cocoa", "mb-sdca"])
def test_gap_closes_with_zero_rows(solver):
    """x_i = 0 has loss 1 whatever w; its dual optimum alpha_i = y_i closes the gap (the old
    MOCHA kernel skipped such rows and left a gap of (#zero rows) / n)."""
    from fmtl_flower.core.baselines import cocoa_local_update, mbsdca_local_update

    X, y = _zero_row_task()
    n, m_tt = X.shape[0], 0.5
    alpha = np.zeros(n)
    for r in range(1, 3001 if solver == "mb-sdca" else 201):
        gap, w = _single_task_gap(X, y, alpha, m_tt)
        order = coordinate_order(0, 0, r, n)
        if solver == "mocha":
            d_alpha, _ = sdca_local_update(X, y, alpha, w, budget=n, m_tt=m_tt,
                                           sigma_prime=1.0, order=order)
        elif solver == "cocoa":
            d_alpha, _, _, _ = cocoa_local_update(X, y, alpha, w, m_tt=m_tt, sigma_prime=1.0,
                                                  theta=0.1, max_steps=10 * n, order=order)
        else:  # one step per round: the server's scale beta / b is 1
            d_alpha, _ = mbsdca_local_update(X, y, alpha, w, m_tt=m_tt, budget=1, order=order)
        alpha = alpha + d_alpha
    gap, _ = _single_task_gap(X, y, alpha, m_tt)
    assert np.all(y[[2, 7]] * alpha[[2, 7]] == 1.0)
    assert -1e-12 <= gap < 1e-6


def test_ofmtl_newcomer_gap_closes_with_zero_rows():
    from fmtl_flower.core.ofmtl import newcomer_duality_gap, newcomer_fit

    X, y = _zero_row_task()
    c = np.zeros(X.shape[1])
    fit = newcomer_fit(X, y, omega=2.0, c=c, lam=0.5, rounds=300, local_frac=1.0, seed=0,
                       task_id=0, track_gap=False)
    assert np.all(y[[2, 7]] * fit.alpha[[2, 7]] == 1.0)
    assert abs(newcomer_duality_gap(X, y, fit.alpha, omega=2.0, c=c, lam=0.5)) < 1e-6


def test_cocoa_plus_zero_row_takes_the_logistic_maximiser():
    """CoCoA+ (logistic dual): for x_i = 0 the coordinate maximises the entropy alone,
    y_i alpha_i = 1/2, the same rule for its loss."""
    import scipy.sparse as sp

    from fmtl_flower.core.fsvrg import cocoa_plus_local_sdca

    X, y = _zero_row_task()
    n = X.shape[0]
    d_alpha, _ = cocoa_plus_local_sdca(sp.csr_matrix(X), y, np.zeros(n), np.zeros(X.shape[1]),
                                       lam=0.1, n=n, sigma_prime=1.0, order=np.arange(n))
    np.testing.assert_allclose(y[[2, 7]] * d_alpha[[2, 7]], 0.5, rtol=1e-12)


# -- the numpy implementations (no numba) against the compiled kernels ------------------------
# (fmtl_flower.core.jit: equal up to rounding, not bit for bit: numba's SDCA kernels reassociate
# sums and fuse multiply-adds; the permutation is bit-identical)


compiled_only = pytest.mark.skipif(not numba_available(), reason="numba is not installed")


def both(run):
    """``run()`` with every kernel compiled, then with every kernel's numpy implementation."""
    with jit.using("numba"):
        compiled = run()
    with jit.using("numpy"):
        plain = run()
    return compiled, plain


@compiled_only
@settings(max_examples=60, deadline=None)
@given(problems())
def test_numpy_mocha_kernel_equals_compiled(problem):
    X, y, alpha, w, budget, m_tt, sigma_p, order = problem
    compiled, plain = both(lambda: sdca_local_update(X, y, alpha, w, budget=budget, m_tt=m_tt,
                                                     sigma_prime=sigma_p, order=order))
    for a, b in zip(compiled, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


@compiled_only
@settings(max_examples=40, deadline=None)
@given(problems(), st.sampled_from([0.0, 0.3, 0.9]), st.integers(1, 7))
def test_numpy_baseline_kernels_equal_compiled(problem, theta, check_every):
    from fmtl_flower.core import baselines as bl

    X, y, alpha, w, budget, m_tt, sigma_p, order = problem
    n = X.shape[0]
    batch = min(budget, n)

    def run():
        return (bl.cocoa_local_update(X, y, alpha, w, m_tt=m_tt, sigma_prime=sigma_p,
                                      theta=theta, max_steps=budget, order=order,
                                      check_every=check_every),
                bl.mbsdca_local_update(X, y, alpha, w, m_tt=m_tt, budget=batch, order=order),
                bl.mbsgd_local_gradient(X, y, w, budget=batch, order=order))

    # CoCoA's driver has no numpy copy: without numba it runs as Python over the numpy gap
    # and SDCA steps
    compiled, plain = both(run)
    (ca, cb, cs, cg), (pa, pb, ps, pg) = compiled[0], plain[0]
    assert cs == ps  # the same number of steps (the gap test is at the same block ends)
    np.testing.assert_allclose(pa, ca, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(pb, cb, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(pg, cg, rtol=1e-7, atol=1e-12)
    for a, b in [*zip(compiled[1], plain[1], strict=True),
                 *zip(compiled[2], plain[2], strict=True)]:
        np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-12)


@compiled_only
@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**40), st.integers(0, 10**6),
       st.integers(0, 300))
def test_numpy_coordinate_order_is_the_compiled_permutation(seed, task, server_round, n):
    from fmtl_flower.core import rng

    keys = [np.uint64(k) for k in (seed, task, server_round, rng.TAG_ORDER)]
    compiled, plain = both(lambda: rng._permutation(*keys, n))
    np.testing.assert_array_equal(plain, compiled)
    np.testing.assert_array_equal(rng._permutation_numpy(*keys, n), compiled)



@compiled_only
def test_cocoa_with_theta_zero_takes_the_same_steps_with_and_without_numba():
    # the local gap reaches exactly 0 after one step without numba (a rounding tie) and a
    # tiny positive value with it (hypothesis found such a case): theta = 0 must not stop
    # on it, so both run to max_steps
    from fmtl_flower.core import baselines as bl

    seed = 74
    rng = np.random.default_rng(seed)
    n, d = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    X = rng.normal(size=(n, d)) * 30.0
    y = rng.choice([-1.0, 1.0], size=n)
    budget = int(rng.integers(1, 3 * n + 1))

    def run():
        return bl.cocoa_local_update(X, y, np.zeros(n), np.zeros(d), m_tt=345.0,
                                     sigma_prime=1.0, theta=0.0, max_steps=budget,
                                     order=coordinate_order(seed, 0, 1, n), check_every=1)

    compiled, plain = both(run)
    assert compiled[2] == plain[2] == budget
    np.testing.assert_allclose(plain[0], compiled[0], rtol=1e-9, atol=1e-12)


# -- every loss of the family (fmtl_flower.core.losses) -----------------------------------------

LOSS_NAMES = ["hinge", "smoothed-hinge", "logistic", "squared"]


@compiled_only
@settings(max_examples=60, deadline=None)
@given(problems(), st.sampled_from(LOSS_NAMES), st.sampled_from([0.0, 0.3]),
       st.integers(1, 7))
def test_numpy_kernels_equal_compiled_for_every_loss(problem, loss, theta, check_every):
    """MOCHA's, CoCoA's and Mb-SDCA's kernels with numba and with numpy, per loss (the device
    works without numba: both must take every loss and agree)."""
    from fmtl_flower.core import baselines as bl

    X, y, alpha, w, budget, m_tt, sigma_p, order = problem
    batch = min(budget, X.shape[0])

    def run():
        return (sdca_local_update(X, y, alpha, w, budget=budget, m_tt=m_tt,
                                  sigma_prime=sigma_p, order=order, loss=loss),
                bl.cocoa_local_update(X, y, alpha, w, m_tt=m_tt, sigma_prime=sigma_p,
                                      theta=theta, max_steps=budget, order=order,
                                      check_every=check_every, loss=loss)[:3],
                bl.mbsdca_local_update(X, y, alpha, w, m_tt=m_tt, budget=batch, order=order,
                                       loss=loss))

    compiled, plain = both(run)
    assert compiled[1][2] == plain[1][2]  # CoCoA: the same number of steps
    for got, want in zip(plain, compiled, strict=True):
        for a, b in zip(got[:2], want[:2], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def _loss_subproblem(loss, X, y, alpha, w, d_alpha, m_tt, sigma_p):
    """G(d_alpha) of the local subproblem with the loss's dual term (up to a constant)."""
    from fmtl_flower.core.losses import LOSSES

    n = X.shape[0]
    d_b = X.T @ d_alpha / n
    return (LOSSES[loss].dual(y * (alpha + d_alpha)).mean() - w @ d_b
            - 0.5 * sigma_p * m_tt * d_b @ d_b)


@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_every_step_increases_the_local_subproblem_and_stays_feasible(loss):
    from fmtl_flower.core.losses import LOSSES

    X, y = _zero_row_task(n=15, d=4, seed=9)
    rng = np.random.default_rng(1)
    alpha = y * rng.uniform(0, 1, size=15)
    w = rng.normal(size=4)
    order = coordinate_order(3, 0, 1, 15)
    values = []
    for budget in range(0, 46):
        d_alpha, _ = sdca_local_update(X, y, alpha, w, budget=budget, m_tt=0.7,
                                       sigma_prime=2.0, order=order, loss=loss)
        assert LOSSES[loss].feasible(alpha + d_alpha, y)
        values.append(_loss_subproblem(loss, X, y, alpha, w, d_alpha, 0.7, 2.0))
    assert all(b >= a - 1e-13 for a, b in zip(values, values[1:], strict=False))
    assert values[-1] > values[0]


@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_single_task_gap_closes_for_every_loss(loss):
    """SDCA rounds on one task (K = 1 / m_tt) drive the duality gap of the loss to 0, zero
    rows included (their maximiser is argmax D)."""
    from fmtl_flower.core.losses import LOSSES

    f = LOSSES[loss]
    X, y = _zero_row_task()
    n, m_tt = X.shape[0], 0.5
    alpha = np.zeros(n)

    def gap_of(alpha):
        b = X.T @ alpha / n
        w = m_tt * b
        primal = f.value(y * (X @ w)).mean() + 0.5 * w @ w / m_tt
        return primal - (f.dual(y * alpha).mean() - 0.5 * m_tt * b @ b), w

    for r in range(1, 301):
        gap, w = gap_of(alpha)
        d_alpha, _ = sdca_local_update(X, y, alpha, w, budget=n, m_tt=m_tt, sigma_prime=1.0,
                                       order=coordinate_order(0, 0, r, n), loss=loss)
        alpha = alpha + d_alpha
    gap, _ = gap_of(alpha)
    np.testing.assert_allclose(y[[2, 7]] * alpha[[2, 7]], f.peak)
    assert -1e-12 <= gap < 1e-9
