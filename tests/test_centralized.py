"""MOCHA run centrally: convergence on small.mat and agreement with independent solvers."""

import numpy as np
import pytest
from scipy.optimize import minimize

from fmtl_flower.centralized import fit_mocha
from fmtl_flower.data import load_dataset, make_synthetic_tasks


def load_or_skip(name, **kwargs):
    try:
        return load_dataset(name, **kwargs)
    except FileNotFoundError as err:
        pytest.skip(f"{name} not available: {err}")


def independent_optimum(X, y, c):
    """max of the SVM dual for min_w mean hinge + (c/2)|w|^2, by L-BFGS-B (not SDCA).

    By strong duality this is the optimum; liblinear does not converge at c = lambda * m here.
    """
    n = len(y)
    Z = X * y[:, None]

    def negative_dual(a):
        u = Z.T @ a / n
        return -(a.sum() / n - 0.5 / c * u @ u), -(np.ones(n) / n - Z @ u / (c * n))

    res = minimize(negative_dual, np.zeros(n), jac=True, bounds=[(0, 1)] * n,
                   method="L-BFGS-B", options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 10**5})
    return -res.fun


def test_small_identity_converges_to_the_decoupled_optimum():
    """Issue figure: relative gap < 1e-3 by round 1000 (lambda=1e-4, local-frac=1, all data)."""
    data = load_or_skip("small", seed=0, test_frac=0.0)
    tasks = [(t.X_train, t.y_train) for t in data.tasks]
    lam, m = 1e-4, len(tasks)
    fit = fit_mocha(tasks, lam=lam, rounds=1000, omega="identity", omega_every=0, seed=0,
                    record_every=100)
    final = fit.history[-1]
    assert final["gap"] / final["primal"] < 1e-3
    gaps = [h["gap"] for h in fit.history]
    assert all(g >= 0 for g in gaps) and gaps[-1] < gaps[1] / 10
    # With Sigma = I/m the problem decouples into per-task SVMs with c = lambda * m.
    optimum = sum(independent_optimum(X, y, lam * m) for X, y in tasks)
    assert final["dual"] <= optimum * (1 + 1e-9) and optimum <= final["primal"] * (1 + 1e-9)
    assert abs(final["primal"] - optimum) / optimum < 1e-3


@pytest.mark.parametrize("omega, sigma_mode", [("identity", "global"),
                                               ("identity", "per-task")])
def test_dual_never_decreases_and_gap_nonnegative_with_omega_fixed(omega, sigma_mode):
    Xs, ys = make_synthetic_tasks(num_tasks=8, dim=6, samples_per_task=30, seed=4)
    tasks = list(zip(Xs, ys, strict=True))
    fit = fit_mocha(tasks, lam=1e-2, rounds=60, omega=omega, omega_every=0,
                    sigma_mode=sigma_mode, seed=1, record_every=1, local_frac=0.7)
    duals = np.array([h["dual"] for h in fit.history])
    gaps = np.array([h["gap"] for h in fit.history])
    assert np.all(np.diff(duals) >= -1e-12)
    assert np.all(gaps >= -1e-12)
    assert gaps[-1] < 0.05 * gaps[0]
    for a, (_, y) in zip(fit.alphas, tasks, strict=True):
        assert np.all(y * a >= 0) and np.all(y * a <= 1)


def test_sigma_is_fixed_within_an_omega_period_and_dual_increases_there():
    Xs, ys = make_synthetic_tasks(num_tasks=6, dim=5, samples_per_task=25, seed=2)
    tasks = list(zip(Xs, ys, strict=True))
    fit = fit_mocha(tasks, lam=1e-2, rounds=40, omega="probabilistic", omega_every=10, seed=0,
                    record_every=1)
    duals = np.array([h["dual"] for h in fit.history])
    gaps = np.array([h["gap"] for h in fit.history])
    assert np.all(gaps >= -1e-12)
    for start in range(0, 40, 10):  # the states start .. start+9 share one Sigma
        period = duals[start: start + 10]
        assert np.all(np.diff(period) >= -1e-12)


def test_same_seed_same_result_and_seed_matters():
    Xs, ys = make_synthetic_tasks(num_tasks=5, dim=4, samples_per_task=20, seed=0)
    tasks = list(zip(Xs, ys, strict=True))
    kwargs = {"lam": 0.1, "rounds": 15, "omega_every": 5, "sys_het": "high", "drop_prob": 0.2}
    a, b = fit_mocha(tasks, seed=3, **kwargs), fit_mocha(tasks, seed=3, **kwargs)
    c = fit_mocha(tasks, seed=4, **kwargs)
    np.testing.assert_array_equal(a.W, b.W)
    assert not np.array_equal(a.W, c.W)
