"""CoCoA, Mb-SDCA and Mb-SGD local solvers and server steps against plain-numpy references."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmtl_flower.core.baselines import (
    cocoa_local_gap,
    cocoa_local_update,
    mbsdca_local_update,
    mbsdca_scale,
    mbsgd_local_gradient,
    mbsgd_objective,
    mbsgd_radius,
    mbsgd_server_step,
    mbsgd_step_size,
)
from fmtl_flower.core.rng import coordinate_order


def make_task(rng, n, d, scales=1.0, noise=0.3):
    X = rng.normal(size=(n, d)) * scales
    y = np.sign(X @ (rng.normal(size=d) / scales) + noise * rng.normal(size=n))
    y[y == 0] = 1.0
    return X, y


# ---- brute-force local subproblem (CoCoA's docstring) --------------------------------------


def local_dual(X, y, alpha, w, d_alpha, c):
    """G(d_alpha) of MOCHA eq. (4), maximisation form."""
    n = X.shape[0]
    d_b = X.T @ d_alpha / n
    return y @ (alpha + d_alpha) / n - w @ d_b - 0.5 * c * d_b @ d_b


def local_primal(X, y, alpha, w, u, c):
    """P_loc(u) = mean hinge at w + u + b^T (w + u) + |u|^2 / (2c)."""
    n = X.shape[0]
    v = w + u
    return np.maximum(0.0, 1.0 - y * (X @ v)).mean() + (X.T @ alpha / n) @ v + u @ u / (2 * c)


def brute_gap(X, y, alpha, w, d_alpha, c):
    u = c * X.T @ d_alpha / X.shape[0]
    return local_primal(X, y, alpha, w, u, c) - local_dual(X, y, alpha, w, d_alpha, c)


@st.composite
def problems(draw):
    n = draw(st.integers(1, 30))
    d = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)) * draw(st.sampled_from([0.1, 1.0, 10.0]))
    if draw(st.booleans()):
        X[rng.integers(n)] = 0.0
    y = rng.choice([-1.0, 1.0], size=n)
    alpha = y * rng.uniform(0, 1, size=n) * draw(st.sampled_from([0.0, 1.0]))
    w = rng.normal(size=d) * draw(st.sampled_from([0.0, 0.3, 3.0]))
    m_tt = draw(st.sampled_from([0.01, 1.0, 50.0]))
    sigma_p = draw(st.sampled_from([1.0, 3.0]))
    return X, y, alpha, w, m_tt, sigma_p, coordinate_order(seed, 0, 1, n)


@settings(max_examples=80, deadline=None)
@given(problems(), st.sampled_from([0.0, 0.1, 0.5]), st.integers(1, 7))
def test_cocoa_stops_at_theta_with_a_true_gap(problem, theta, check_every):
    X, y, alpha, w, m_tt, sigma_p, order = problem
    n, c = X.shape[0], m_tt * sigma_p
    max_steps = 40 * n
    d_alpha, d_b, steps, rel = cocoa_local_update(
        X, y, alpha, w, m_tt=m_tt, sigma_prime=sigma_p, theta=theta, max_steps=max_steps,
        order=order, check_every=check_every)
    a = y * (alpha + d_alpha)
    assert np.all(a >= -1e-15) and np.all(a <= 1 + 1e-15)  # dual feasibility
    np.testing.assert_allclose(d_b, X.T @ d_alpha / n, atol=1e-13)
    gap0 = brute_gap(X, y, alpha, w, np.zeros(n), c)
    gap = brute_gap(X, y, alpha, w, d_alpha, c)
    assert gap >= -1e-12 and gap0 >= -1e-12  # weak duality of the local pair
    if gap0 <= 1e-300:
        assert steps == 0 and rel == 0.0
        return
    np.testing.assert_allclose(rel, gap / gap0, rtol=1e-7, atol=1e-12)
    np.testing.assert_allclose(
        cocoa_local_gap(X, y, alpha, w, d_alpha, m_tt=m_tt, sigma_prime=sigma_p), gap,
        rtol=1e-9, atol=1e-13)
    assert 0 <= steps <= max_steps
    if steps < max_steps:
        assert rel <= theta and steps % check_every == 0
        # the stop is the first check that meets theta
        if steps >= check_every:
            d2, _, s2, rel2 = cocoa_local_update(
                X, y, alpha, w, m_tt=m_tt, sigma_prime=sigma_p, theta=theta,
                max_steps=steps - check_every, order=order, check_every=check_every)
            assert s2 == steps - check_every and rel2 > theta
    # SDCA never decreases the local dual objective
    assert local_dual(X, y, alpha, w, d_alpha, c) >= local_dual(X, y, alpha, w, 0 * d_alpha, c) \
        - 1e-12


def test_local_primal_is_a_dual_of_the_subproblem():
    """Weak duality for random pairs, and zero gap (= equal optima) at the solution."""
    rng = np.random.default_rng(3)
    X, y = make_task(rng, 50, 4)
    alpha = y * rng.uniform(0, 1, 50) * 0.5
    w = rng.normal(size=4) * 0.3
    m_tt, sp = 2.0, 1.5
    c = m_tt * sp
    for _ in range(300):
        d_alpha = y * rng.uniform(0, 1, 50) - alpha
        u = rng.normal(size=4) * rng.choice([0.01, 1.0])
        assert local_primal(X, y, alpha, w, u, c) >= local_dual(X, y, alpha, w, d_alpha, c)
    d_alpha, d_b, steps, rel = cocoa_local_update(
        X, y, alpha, w, m_tt=m_tt, sigma_prime=sp, theta=1e-10, max_steps=10**6,
        order=coordinate_order(0, 0, 1, 50), check_every=1)
    assert rel <= 1e-10 and steps < 10**6
    g_star = local_dual(X, y, alpha, w, d_alpha, c)
    assert abs(local_primal(X, y, alpha, w, c * d_b, c) - g_star) < 1e-9
    # gap(0) is an upper bound on the true suboptimality at 0 (the denominator of eq. (5))
    assert g_star - local_dual(X, y, alpha, w, 0 * alpha, c) <= \
        brute_gap(X, y, alpha, w, 0 * alpha, c) + 1e-12


def test_cocoa_step_counts_vary_with_conditioning():
    rng = np.random.default_rng(0)
    d = 6
    well = make_task(rng, 60, d, noise=0.05)
    mid = make_task(rng, 60, d, scales=np.logspace(0, 1, d), noise=0.3)
    ill = make_task(rng, 60, d, scales=np.logspace(0, 2, d), noise=1.0)
    counts = []
    for t, (X, y) in enumerate((well, mid, ill)):
        _, _, steps, rel = cocoa_local_update(
            X, y, np.zeros(60), np.zeros(d), m_tt=1.0, sigma_prime=1.0, theta=0.2,
            max_steps=100_000, order=coordinate_order(0, t, 1, 60), check_every=5)
        assert rel <= 0.2
        counts.append(steps)
    assert counts[0] < counts[1] < counts[2]
    assert counts[2] > 10 * counts[0]  # same n and theta, ~45x the work


def test_cocoa_counts_spread_across_nodes_and_grow_over_rounds():
    """The paper's observation (appendix E.3) on a decoupled 3-task problem (K = kappa I)."""
    rng = np.random.default_rng(1)
    d, kappa = 6, 0.03
    tasks = [make_task(rng, 40, d, noise=0.1),
             make_task(rng, 80, d, scales=np.logspace(0, 1, d), noise=0.3),
             make_task(rng, 120, d, scales=np.logspace(0, 1.5, d), noise=0.5)]
    alphas = [np.zeros(X.shape[0]) for X, _ in tasks]
    B = np.zeros((d, 3))
    history = []
    for r in range(1, 13):
        W = B / kappa
        row = []
        for t, (X, y) in enumerate(tasks):
            n = X.shape[0]
            da, db, steps, _ = cocoa_local_update(
                X, y, alphas[t], W[:, t], m_tt=1 / kappa, sigma_prime=1.0, theta=0.3,
                max_steps=200 * n, order=coordinate_order(0, t, r, n), check_every=10)
            alphas[t] += da
            B[:, t] += db
            row.append(steps)
        history.append(row)
    h = np.array(history)
    assert np.all(h.max(axis=1) > 5 * h.min(axis=1))  # stragglers every round
    assert h[-4:].max(axis=1).mean() > 1.5 * h[:3].max(axis=1).mean()  # and they slow down


def test_cocoa_cap_and_zero_rows():
    rng = np.random.default_rng(2)
    X, y = make_task(rng, 20, 3)
    X[4] = 0.0
    d_alpha, d_b, steps, rel = cocoa_local_update(
        X, y, np.zeros(20), np.zeros(3), m_tt=1.0, sigma_prime=1.0, theta=0.0, max_steps=33,
        order=coordinate_order(1, 0, 1, 20), check_every=10)
    assert steps == 33 and 0 < rel < 1
    assert y[4] * d_alpha[4] == 1.0  # zero row at its exact maximiser, not skipped
    d_alpha, d_b, steps, rel = cocoa_local_update(
        X, y, np.zeros(20), np.zeros(3), m_tt=1.0, sigma_prime=1.0, theta=0.5, max_steps=0,
        order=np.arange(20))
    assert steps == 0 and rel == 1.0 and not d_alpha.any() and not d_b.any()
    empty = cocoa_local_update(np.zeros((0, 3)), np.zeros(0), np.zeros(0), np.zeros(3),
                               m_tt=1.0, sigma_prime=1.0, theta=0.5, max_steps=5,
                               order=np.zeros(0, dtype=np.int64))
    assert empty[2] == 0 and empty[1].shape == (3,)
    # read-only inputs (as decoded from wire records) are fine
    for arr in (X, y):
        arr.setflags(write=False)
    _, _, steps, _ = cocoa_local_update(X, y, np.zeros(20), np.zeros(3), m_tt=1.0,
                                        sigma_prime=1.0, theta=0.5, max_steps=100,
                                        order=np.arange(20))
    assert steps > 0


def test_cocoa_errors():
    X, y = np.ones((3, 2)), np.array([1.0, -1.0, 1.0])
    kw = dict(m_tt=1.0, sigma_prime=1.0, theta=0.5, max_steps=5, order=np.arange(3))
    for bad, match in ((dict(theta=1.0), "theta"), (dict(theta=-0.1), "theta"),
                       (dict(m_tt=0.0), "m_tt"), (dict(sigma_prime=np.nan), "sigma_prime"),
                       (dict(max_steps=-1), "max_steps"), (dict(max_steps=2.5), "max_steps"),
                       (dict(check_every=0), "check_every"), (dict(order=np.arange(4)), "order")):
        with pytest.raises(ValueError, match=match):
            cocoa_local_update(X, y, np.zeros(3), np.zeros(2), **{**kw, **bad})
    with pytest.raises(ValueError, match="alpha"):
        cocoa_local_update(X, y, np.zeros(2), np.zeros(2), **kw)
    with pytest.raises(ValueError, match="w must"):
        cocoa_local_update(X, y, np.zeros(3), np.zeros(3), **kw)
    with pytest.raises(ValueError, match="y must"):
        cocoa_local_update(X, y[:2], np.zeros(3), np.zeros(2), **kw)


# ---- Mb-SDCA ---------------------------------------------------------------------------------


def reference_mbsdca(X, y, alpha, w, m_tt, budget, order):
    n = X.shape[0]
    d_alpha = np.zeros(n)
    for s in range(budget):
        i = order[s]
        x = X[i]
        a_old = y[i] * alpha[i]
        if x @ x == 0:
            a_new = 1.0
        else:
            a_new = np.clip(a_old + (1 - y[i] * (x @ w)) / (m_tt * (x @ x) / n), 0, 1)
        d_alpha[i] = y[i] * (a_new - a_old)
    return d_alpha, X.T @ d_alpha / n


@settings(max_examples=80, deadline=None)
@given(problems(), st.floats(0.0, 1.0))
def test_mbsdca_matches_stale_reference(problem, frac):
    X, y, alpha, w, m_tt, _, order = problem
    n = X.shape[0]
    budget = int(frac * n)
    d_alpha, d_b = mbsdca_local_update(X, y, alpha, w, m_tt=m_tt, budget=budget, order=order)
    ref_alpha, ref_b = reference_mbsdca(X, y, alpha, w, m_tt, budget, order)
    np.testing.assert_allclose(d_alpha, ref_alpha, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(d_b, ref_b, rtol=1e-10, atol=1e-13)
    assert not d_alpha[order[budget:]].any()  # only the mini-batch moves
    for s in (1.0, mbsdca_scale(3.0, max(budget, 1) * 7)):
        a = y * (alpha + s * d_alpha)
        assert np.all(a >= -1e-15) and np.all(a <= 1 + 1e-15)


def test_mbsdca_uses_the_stale_model():
    """Two identical rows: both get the same step (no local progress between them)."""
    X = np.array([[1.0, 2.0], [1.0, 2.0], [0.5, -1.0]])
    y = np.array([1.0, 1.0, -1.0])
    w = np.array([0.1, 0.0])
    d_alpha, _ = mbsdca_local_update(X, y, np.zeros(3), w, m_tt=10.0, budget=3,
                                     order=np.array([0, 1, 2]))
    assert d_alpha[0] == d_alpha[1] > 0
    from fmtl_flower.core.sdca import sdca_local_update

    fresh, _ = sdca_local_update(X, y, np.zeros(3), w, budget=3, m_tt=10.0, sigma_prime=1.0,
                                 order=np.array([0, 1, 2]))
    assert fresh[1] < fresh[0]  # MOCHA's SDCA sees the first step


def test_mbsdca_scaled_rounds_increase_the_dual():
    """With beta = 1 (s = 1/b) every round is a convex combination of exact single-coordinate
    maximisers of the dual, so D never decreases (identity K = kappa I)."""
    rng = np.random.default_rng(5)
    d, kappa = 4, 0.05
    tasks = [make_task(rng, n, d) for n in (30, 50, 80)]
    alphas = [np.zeros(X.shape[0]) for X, _ in tasks]
    B = np.zeros((d, 3))

    def dual():
        return sum(y @ a / len(y) for (_, y), a in zip(tasks, alphas, strict=True)) \
            - 0.5 * np.sum(B * B) / kappa

    values = [dual()]
    for r in range(1, 30):
        W = B / kappa
        updates = []
        for t, (X, y) in enumerate(tasks):
            n = X.shape[0]
            updates.append(mbsdca_local_update(X, y, alphas[t], W[:, t], m_tt=1 / kappa,
                                               budget=n // 2,
                                               order=coordinate_order(0, t, r, n)))
        s = mbsdca_scale(1.0, sum(X.shape[0] // 2 for X, _ in tasks))
        for t, (da, db) in enumerate(updates):
            alphas[t] = alphas[t] + s * da
            B[:, t] += s * db
        values.append(dual())
    assert np.all(np.diff(values) >= -1e-12) and values[-1] > values[0]


def test_mbsdca_errors_and_scale():
    X, y = np.ones((3, 2)), np.array([1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="budget"):
        mbsdca_local_update(X, y, np.zeros(3), np.zeros(2), m_tt=1.0, budget=4,
                            order=np.arange(3))
    with pytest.raises(ValueError, match="m_tt"):
        mbsdca_local_update(X, y, np.zeros(3), np.zeros(2), m_tt=-1.0, budget=1,
                            order=np.arange(3))
    assert mbsdca_scale(10.0, 1000) == 0.01
    assert mbsdca_scale(10.0, 4) == 1.0  # clipped: stays feasible
    assert mbsdca_scale(10.0, 0) == 0.0
    with pytest.raises(ValueError, match="beta"):
        mbsdca_scale(0.0, 5)
    with pytest.raises(ValueError, match="total_steps"):
        mbsdca_scale(1.0, -1)


# ---- Mb-SGD ----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(problems(), st.floats(0.0, 1.0))
def test_mbsgd_gradient_matches_numpy(problem, frac):
    X, y, _, w, _, _, order = problem
    budget = int(frac * X.shape[0])
    g, steps = mbsgd_local_gradient(X, y, w, budget=budget, order=order)
    S = order[:budget]
    active = y[S] * (X[S] @ w) < 1
    expected = -(y[S][active, None] * X[S][active]).sum(axis=0)
    np.testing.assert_allclose(g, expected, rtol=1e-12, atol=1e-12)
    assert steps == budget


def _tasks_and_K(seed=7, m=4, d=5):
    rng = np.random.default_rng(seed)
    tasks = [make_task(rng, n, d, noise=0.5) for n in rng.integers(60, 120, size=m)]
    A = rng.normal(size=(m, m))
    K = 0.05 * (A @ A.T / m + np.eye(m))
    return rng, tasks, K


def test_mbsgd_server_step_full_batch_is_the_subgradient_step():
    rng, tasks, K = _tasks_and_K()
    d, m = 5, len(tasks)
    W = rng.normal(size=(d, m))
    G = np.zeros((d, m))
    counts = np.array([X.shape[0] for X, _ in tasks])
    for t, (X, y) in enumerate(tasks):
        G[:, t], _ = mbsgd_local_gradient(X, y, W[:, t], budget=X.shape[0],
                                          order=np.arange(X.shape[0]))
    W_new = mbsgd_server_step(W, G, K, counts=counts, step=0.1)
    grad = W @ K
    for t, (X, y) in enumerate(tasks):  # per-task mean, not pooled
        act = y * (X @ W[:, t]) < 1
        grad[:, t] -= (y[act, None] * X[act]).sum(axis=0) / X.shape[0]
    np.testing.assert_allclose(W_new, W - 0.1 * grad, rtol=1e-12, atol=1e-12)
    # full-batch small steps decrease P (P is differentiable almost everywhere)
    P0 = mbsgd_objective(tasks, W, K)
    assert mbsgd_objective(tasks, mbsgd_server_step(W, G, K, counts=counts, step=1e-3),
                           K) < P0


def test_mbsgd_minibatch_steps_decrease_P_on_average():
    rng, tasks, K = _tasks_and_K(seed=8)
    d, m = 5, len(tasks)
    W = rng.normal(size=(d, m))
    P0 = mbsgd_objective(tasks, W, K)
    changes = []
    for r in range(1, 101):
        G = np.zeros((d, m))
        counts = np.zeros(m, dtype=int)
        for t, (X, y) in enumerate(tasks):
            G[:, t], counts[t] = mbsgd_local_gradient(
                X, y, W[:, t], budget=10, order=coordinate_order(3, t, r, X.shape[0]))
        changes.append(mbsgd_objective(tasks, mbsgd_server_step(W, G, K, counts=counts,
                                                                step=1e-3), K) - P0)
    assert np.mean(changes) < 0
    # dropped task (count 0): only the regulariser moves its column
    G[:, 0] = 123.0
    counts[0] = 0
    W_new = mbsgd_server_step(W, G, K, counts=counts, step=0.1)
    np.testing.assert_allclose(W_new[:, 0], W[:, 0] - 0.1 * (W @ K)[:, 0])


def test_pegasos_run_converges_and_radius_contains_the_optimum():
    """Identity K = kappa I: solve each SVM exactly with CoCoA (sigma' = 1 is exact SDCA when
    tasks decouple), check the radius bound and the identity tr(W K W^T) = sum A - sum L, then
    run Mb-SGD with Pegasos's step 1/(mu h) and projection and get close to P*."""
    rng = np.random.default_rng(11)
    d, kappa = 4, 0.1
    tasks = [make_task(rng, n, d, noise=0.5) for n in (80, 120, 100)]
    m = len(tasks)
    K = kappa * np.eye(m)
    W_star = np.zeros((d, m))
    A = np.zeros(m)
    for t, (X, y) in enumerate(tasks):
        n = X.shape[0]
        alpha, b = np.zeros(n), np.zeros(d)
        for r in range(1, 200):
            da, db, _, rel = cocoa_local_update(X, y, alpha, b / kappa, m_tt=1 / kappa,
                                                sigma_prime=1.0, theta=1e-3, max_steps=50 * n,
                                                order=coordinate_order(0, t, r, n))
            alpha += da
            b += db
            if cocoa_local_gap(X, y, alpha, b / kappa, np.zeros(n), m_tt=1 / kappa,
                               sigma_prime=1.0) < 1e-10:
                break
        W_star[:, t] = b / kappa
        A[t] = y @ alpha / n
    P_star = mbsgd_objective(tasks, W_star, K)
    L = np.array([np.maximum(0, 1 - y * (X @ W_star[:, t])).mean()
                  for t, (X, y) in enumerate(tasks)])
    np.testing.assert_allclose(np.trace(W_star @ K @ W_star.T), A.sum() - L.sum(), atol=1e-8)
    radius = mbsgd_radius(K)
    assert radius == pytest.approx(np.sqrt(m / kappa))
    assert np.linalg.norm(W_star) <= radius

    W = np.zeros((d, m))
    for h in range(1, 3001):
        G = np.zeros((d, m))
        counts = np.zeros(m, dtype=int)
        for t, (X, y) in enumerate(tasks):
            G[:, t], counts[t] = mbsgd_local_gradient(
                X, y, W[:, t], budget=X.shape[0] // 2,
                order=coordinate_order(1, t, h, X.shape[0]))
        W = mbsgd_server_step(W, G, K, counts=counts, radius=radius,
                              step=mbsgd_step_size(h, beta=1 / kappa))
        assert np.linalg.norm(W) <= radius * (1 + 1e-12)
    assert mbsgd_objective(tasks, W, K) - P_star < 1e-3 * P_star


def test_mbsgd_helpers_errors():
    assert mbsgd_step_size(4, beta=2.0) == 0.5
    assert mbsgd_step_size(4, beta=2.0, schedule="inv_sqrt") == 1.0
    with pytest.raises(ValueError, match="schedule"):
        mbsgd_step_size(1, beta=1.0, schedule="const")
    with pytest.raises(ValueError, match="server_round"):
        mbsgd_step_size(0, beta=1.0)
    with pytest.raises(ValueError, match="positive definite"):
        mbsgd_radius(np.array([[1.0, 0.0], [0.0, 0.0]]))
    W, G, K = np.zeros((2, 3)), np.zeros((2, 3)), np.eye(3)
    with pytest.raises(ValueError, match="counts"):
        mbsgd_server_step(W, G, K, counts=np.array([1, -1, 1]), step=0.1)
    with pytest.raises(ValueError, match="K must"):
        mbsgd_server_step(W, G, np.eye(2), counts=np.ones(3), step=0.1)
    with pytest.raises(ValueError, match="G must"):
        mbsgd_server_step(W, G[:, :2], K, counts=np.ones(3), step=0.1)
    with pytest.raises(ValueError, match="step"):
        mbsgd_server_step(W, G, K, counts=np.ones(3), step=0.0)
    with pytest.raises(ValueError, match="budget"):
        mbsgd_local_gradient(np.ones((3, 2)), np.ones(3), np.zeros(2), budget=4,
                             order=np.arange(3))
