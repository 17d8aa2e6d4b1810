"""OFMTL's newcomer subproblem under a loss other than the hinge (``mocha.loss``).

The newcomer minimises P_new(w) = (1/n) sum_i l(y_i x_i^T w) + (lam omega / 2) |w|^2 +
lam c^T w (:mod:`fmtl_flower.core.ofmtl`, (*)). Each test writes P_new out again here, apart
from the Loss class under test, and checks the SDCA solution against scipy's minimiser with
the duality gap as the certificate: P_new(w_sdca) - P_new(w_scipy) <= gap and the dual value
is below scipy's primal (weak duality).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize

from fmtl_flower.core.ofmtl import (
    add_task,
    newcomer_dual,
    newcomer_duality_gap,
    newcomer_fit,
    newcomer_primal,
)

from .test_ofmtl import make_task, old_state
from .test_toy_loss import SquaredHinge, toy  # noqa: F401 - toy is a fixture

LAM = 0.05


def _logistic_primal(X, y, w, omega, c):
    """P_new with l(z) = log(1 + e^-z), and its gradient (l'(z) = -1 / (1 + e^z))."""
    z = y * (X @ w)
    loss = np.logaddexp(0.0, -z).mean()
    slope = -np.exp(-np.logaddexp(0.0, z))
    grad = X.T @ (y * slope) / X.shape[0] + LAM * omega * w + LAM * c
    return loss + 0.5 * LAM * omega * w @ w + LAM * c @ w, grad


def _squared_hinge_primal(X, y, w, omega, c):
    """P_new with l(z) = max(0, 1 - z)^2 / 2 (the toy loss), and its gradient."""
    r = np.maximum(0.0, 1.0 - y * (X @ w))
    grad = -X.T @ (y * r) / X.shape[0] + LAM * omega * w + LAM * c
    return 0.5 * (r * r).mean() + 0.5 * LAM * omega * w @ w + LAM * c @ w, grad


def _scipy_optimum(primal, X, y, omega, c):
    out = minimize(lambda w: primal(X, y, w, omega, c), np.zeros(X.shape[1]), jac=True,
                   method="L-BFGS-B", options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 5000})
    return out.x, float(out.fun)


def _newcomer(seed: int):
    """A newcomer's data (one zero row: the zero-row rule) and its server quantities."""
    rng = np.random.default_rng(seed)
    W_old, _, omega_mat = old_state(rng, 4, 3)
    X, y = make_task(rng, 50, 4)
    X[7] = 0.0
    omega = float(omega_mat[3, 3])
    c = W_old @ omega_mat[:3, 3]
    assert np.linalg.norm(c) > 0.1  # a coupled subproblem, not w(0) = 0
    return X, y, omega, c


@pytest.mark.parametrize("loss, primal", [("logistic", _logistic_primal),
                                          ("toy", _squared_hinge_primal)])
def test_a_newcomer_reaches_its_subproblems_optimum_with_a_certified_gap(loss, primal, request):
    loss = request.getfixturevalue("toy") if loss == "toy" else loss
    X, y, omega, c = _newcomer(3)
    kw = {"omega": omega, "c": c, "lam": LAM}
    fit = newcomer_fit(X, y, **kw, rounds=300, local_frac=1.0, seed=1, task_id=3, loss=loss)
    w_ref, p_ref = _scipy_optimum(primal, X, y, omega, c)
    gap = fit.gaps[-1]
    assert -1e-14 <= gap < 1e-10  # 0 to rounding
    assert gap == newcomer_duality_gap(X, y, fit.alpha, **kw, loss=loss)
    p_fit = primal(X, y, fit.w, omega, c)[0]
    assert newcomer_primal(X, y, fit.w, **kw, loss=loss) == pytest.approx(p_fit, rel=1e-12)
    # the certificate: the SDCA model is within its gap of scipy's optimum, and the dual value
    # (a lower bound on every primal value) is below scipy's
    assert p_fit - p_ref <= gap + 1e-12
    assert newcomer_dual(X, y, fit.alpha, **kw, loss=loss) <= p_ref + 1e-12
    # P_new is (lam omega)-strongly convex: |w - w*|^2 <= 2 (P(w) - P*) / (lam omega)
    assert np.linalg.norm(fit.w - w_ref) <= np.sqrt(2 * (gap + 1e-12) / (LAM * omega)) + 1e-6
    assert np.all(np.diff(fit.duals) >= -1e-12)  # exact coordinate ascent
    early = newcomer_fit(X, y, **kw, rounds=2, local_frac=0.5, seed=1, task_id=3, loss=loss)
    assert early.gaps[-1] > 1e-8  # not yet optimal, and its gap still bounds the distance
    assert primal(X, y, early.w, omega, c)[0] - p_ref <= early.gaps[-1] + 1e-12
    if loss == "logistic":
        assert y[7] * fit.alpha[7] == 0.5  # the zero row at argmax D
        assert np.all((y * fit.alpha > 0.0) & (y * fit.alpha < 1.0))


def test_the_hinge_is_the_default_and_another_loss_changes_the_solution():
    X, y, omega, c = _newcomer(4)
    kw = {"omega": omega, "c": c, "lam": LAM, "rounds": 20, "local_frac": 1.0, "seed": 2,
          "task_id": 3}
    hinge = newcomer_fit(X, y, **kw)
    np.testing.assert_array_equal(hinge.w, newcomer_fit(X, y, **kw, loss="hinge").w)
    logistic = newcomer_fit(X, y, **kw, loss="logistic")
    assert not np.allclose(hinge.w, logistic.w)
    with pytest.raises(ValueError, match="loss must be one of"):
        newcomer_fit(X, y, **kw, loss="cubic")
    # a dual of the squared loss (outside [0, 1]) is not a logistic dual
    alpha = y * np.full(X.shape[0], 1.5)
    with pytest.raises(ValueError, match="dual domain of the logistic loss"):
        newcomer_dual(X, y, alpha, omega=omega, c=c, lam=LAM, loss="logistic")
    assert np.isfinite(newcomer_dual(X, y, alpha, omega=omega, c=c, lam=LAM, loss="squared"))


def test_add_task_under_the_toy_loss_ends_at_its_subproblems_optimum(toy):  # noqa: F811
    rng = np.random.default_rng(5)
    W_old, sigma, _ = old_state(rng, 4, 3)
    X, y = make_task(rng, 40, 4)
    out = add_task(W_old, sigma[:3, :3] / np.trace(sigma[:3, :3]), X, y, lam=LAM, outer=3,
                   inner=200, local_frac=1.0, seed=3, task_id=3, loss=toy)
    assert np.all(out.gaps >= -1e-15) and out.gaps[-1] < 1e-10  # 0 to rounding
    w_ref, _ = _scipy_optimum(_squared_hinge_primal, X, y, out.omega, out.c)
    np.testing.assert_allclose(out.w, w_ref, atol=1e-5)
    np.testing.assert_array_equal(out.W[:, :3], W_old)
    assert isinstance(toy, SquaredHinge)
