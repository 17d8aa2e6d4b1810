"""Barrier-free MOCHA and CoCoA with every loss of :mod:`fmtl_flower.core.losses`: after
every reply W = B M and B = X^T alpha / n (1e-12), the tracked dual never above the exact
dual of the devices' alphas (equal unless a curved loss's step was applied with 0 < g < 1,
until the task's next reply) and never decreasing; the final certified gap bounds the true
sub-optimality against synchronous MOCHA's optimum of the same loss and is within 1e-6 of
it; with an intercept and multi-class data through the same lifting synchronous MOCHA uses.
(The old code refused every loss but the hinge: these tests fail there.)"""

from __future__ import annotations

import numpy as np
import pytest

from fmtl_flower.centralized import fit_mocha
from fmtl_flower.core.async_mocha import (
    APPLIED,
    AsyncDevice,
    ReplyBounds,
    Request,
    conjugate_change,
    simulate_async_mocha,
    simulate_sync_mocha,
)
from fmtl_flower.core.losses import LOSSES, get_loss
from fmtl_flower.core.multiclass import lift, with_intercept

from .async_problems import coupled_tasks, server_alphas

COUPLED = dict(lam=0.05, omega="mean", formulation_options={"lam2": 0.01})


class _Checks:
    """After every event: B = X^T alpha / n, W = B M, alpha feasible, the tracked dual a
    lower bound of the exact one (equal for tasks whose A_t is not flagged low), monotone."""

    def __init__(self, tasks, loss):
        self.tasks, self.loss, self.duals, self.partial = tasks, get_loss(loss), [], 0

    def __call__(self, run, record):
        server, tasks, loss = run.server, self.tasks, self.loss
        alphas = server_alphas(server, run.devices)
        B = np.column_stack([X.T @ a / X.shape[0] for a, (X, _) in zip(alphas, tasks,
                                                                          strict=True)])
        assert np.abs(server.state.B - B).max() <= 1e-12
        assert np.abs(server.state.W - server.state.B @ server.state.M).max() <= 1e-12
        exact = np.array([loss.dual_mean(a, y) for a, (_, y) in zip(alphas, tasks, strict=True)])
        for a, (_, y) in zip(alphas, tasks, strict=True):
            assert loss.feasible(a, y, tol=1e-12)
        low = server.conjugate_low
        assert np.all(server.conjugate[low] <= exact[low] + 1e-12)
        assert np.allclose(server.conjugate[~low], exact[~low], rtol=0, atol=1e-12)
        reg = 0.5 * float(np.einsum("ij,ij->", B @ server.state.M, B))
        assert server.dual() <= float(exact.sum()) - reg + 1e-12
        self.partial += record["status"] == APPLIED and 0.0 < record["gamma"] < 1.0
        self.duals.append(record["dual"])

    def monotone(self) -> bool:
        duals = np.asarray(self.duals)
        return bool(np.all(np.diff(duals) >= -1e-13 * np.abs(duals).max()))


def _optimum(tasks, loss) -> float:
    """P* of the coupled problem: synchronous MOCHA with ``loss`` to a gap of 1e-11."""
    ref = fit_mocha(tasks, rounds=3000, omega_every=0, seed=0, loss=loss, **{
        "lam": COUPLED["lam"], "omega": COUPLED["omega"], **COUPLED["formulation_options"]})
    p_star = ref.history[-1]["primal"]
    assert ref.history[-1]["gap"] <= 1e-11 * abs(p_star)
    return p_star


def _assert_certified_near(run, p_star):
    """Every certified gap bounds P(W_eval) - P* and P* - D; the last is <= 1e-6 relative and
    its primal and dual are within 1e-6 of P*."""
    tol = 2e-11 * abs(p_star)
    certified = [r for r in run.records if r["gap"] is not None]
    for r in certified:
        assert r["gap"] >= r["primal"] - p_star - tol
        assert r["gap"] >= p_star - r["dual"] - tol
    last = certified[-1]
    assert 0 <= last["gap"] <= 1e-6 * abs(p_star)
    assert abs(last["primal"] - p_star) <= 1e-6 * abs(p_star)
    assert abs(last["dual"] - p_star) <= 1e-6 * abs(p_star)


@pytest.mark.parametrize(("method", "local_frac"), [("mocha", 1.0), ("cocoa", 3.0)])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_every_loss_certified_near_the_synchronous_optimum(loss, method, local_frac):
    """Coupled tasks, 4 of 6 in flight, tau 5, log-normal delays (stale replies: with
    MOCHA's budget the safeguard scales some of them, 0 < g < 1); CoCoA's local solver with
    up to 3 passes, stopping once its local gap fell by theta = 0.5."""
    tasks = coupled_tasks()
    checks = _Checks(tasks, loss)
    run = simulate_async_mocha(tasks, np.linspace(1.0, 3.0, 6), **COUPLED, replies=6 * 1500,
                               concurrency=4, tau=5, latency_sigma=1.0, seed=4, loss=loss,
                               method=method, theta=0.5, local_frac=local_frac,
                               stop_relative_gap=1e-8, on_event=checks)
    assert checks.monotone()
    assert max(r["staleness"] for r in run.records) > 0
    _assert_certified_near(run, _optimum(tasks, loss))


@pytest.mark.parametrize("loss", [name for name in LOSSES if name != "hinge"])
def test_the_synchronous_baseline_trains_the_runs_loss(loss):
    """The synchronous baseline an asynchronous run of a loss is compared with trains that
    loss: with every task in flight and no safeguard, the asynchronous run's round ends are
    its rounds (B and the dual), and its certified primal is the loss's P at the models the
    devices evaluated (the old baseline trained and reported the hinge whatever the loss)."""
    tasks = coupled_tasks()
    a = simulate_async_mocha(tasks, np.ones(6), lam=0.05, replies=6 * 5, seed=3,
                             safeguard=False, loss=loss)
    s = simulate_sync_mocha(tasks, np.ones(6), np.zeros(6), lam=0.05, rounds=5, seed=3,
                            loss=loss)
    assert np.allclose(a.server.state.B, s.server.B, rtol=0, atol=1e-15)
    ends = [r for r in a.records if r["applied"] % 6 == 0]
    for x, y in zip(ends, s.records, strict=True):
        assert x["dual"] == pytest.approx(y["dual"], abs=1e-14)
    assert s.records[-1]["primal"] == pytest.approx(ends[-1]["primal"], rel=1e-12)


def test_curved_losses_partial_steps_are_exact_again_after_the_next_reply():
    """A small gamma (0.5) makes every applied step partial: the server's A_t is the chord's
    lower bound until the task's next reply, whose exact dual-mean it takes; the dual stays
    monotone and the final certificate as tight as with whole steps."""
    tasks = coupled_tasks()
    loss = "logistic"
    checks = _Checks(tasks, loss)
    run = simulate_async_mocha(tasks, np.linspace(1.0, 3.0, 6), **COUPLED, replies=6 * 1500,
                               concurrency=4, tau=5, latency_sigma=1.0, seed=4, loss=loss,
                               gamma=0.5, stop_relative_gap=1e-8, on_event=checks)
    assert checks.monotone() and checks.partial > 100
    _assert_certified_near(run, _optimum(tasks, loss))


def test_intercept_and_multiclass_through_the_lifting():
    """Three classes and an intercept (scaling 2), one-vs-rest lifted exactly as the devices
    of synchronous MOCHA lift them (:func:`~fmtl_flower.core.multiclass.lift`): async MOCHA
    with the smoothed hinge reaches synchronous MOCHA's optimum of the lifted problem."""
    rng = np.random.default_rng(8)
    centers = rng.standard_normal((3, 4)) * 2
    tasks = []
    for t in range(5):
        labels = rng.integers(0, 3, size=20 + 4 * t)
        X = centers[labels] + rng.standard_normal((labels.size, 4))
        tasks.append(lift(with_intercept(X, 2.0), labels, 3))
    assert tasks[0][0].shape[1] == 15
    checks = _Checks(tasks, "smoothed-hinge")
    run = simulate_async_mocha(tasks, np.linspace(1.0, 2.0, 5), **COUPLED, replies=5 * 1500,
                               concurrency=3, tau=4, latency_sigma=1.0, seed=2,
                               loss="smoothed-hinge", stop_relative_gap=1e-8, on_event=checks)
    assert checks.monotone()
    _assert_certified_near(run, _optimum(tasks, "smoothed-hinge"))


@pytest.mark.parametrize("loss", [n for n in LOSSES if n != "hinge"])
def test_conjugate_change_is_the_chord_of_a_concave_term(loss):
    """The reply's change of the conjugate term: exact at g = 1, and g times it never above
    the true change of a step scaled by g."""
    X, y = coupled_tasks()[2]
    L = get_loss(loss)
    device = AsyncDevice(2, X, y, loss)
    request = Request(2, 1, 1, 0, np.zeros(5), 2.0, 1.0, X.shape[0], 0, 0, 1.0, loss=loss)
    device.handle(request)
    alpha, step = device.alpha, device.pending[1]
    delta = conjugate_change(L, alpha, step, y)
    assert delta == pytest.approx(L.dual_mean(alpha + step, y) - L.dual_mean(alpha, y),
                                  abs=1e-15)
    for g in (0.1, 0.5, 0.9):
        assert g * delta <= L.dual_mean(alpha + g * step, y) - L.dual_mean(alpha, y) + 1e-15


def test_device_refuses_a_request_of_another_loss():
    X, y = coupled_tasks()[0]
    device = AsyncDevice(0, X, y, "logistic")
    with pytest.raises(ValueError, match="logistic"):
        device.handle(Request(0, 1, 1, 0, np.zeros(5), 1.0, 1.0, 3, 0, 0, 1.0))


def test_reply_bounds_follow_the_loss():
    """The squared loss's dual domain is unbounded: no |delta-b| bound but 0 for 0 steps,
    and its loss bound is (1 + R |w|)^2 / 2; the classification losses keep the hinge's."""
    X, y = coupled_tasks()[0]
    squared = ReplyBounds.of_tasks([(X, y)], loss="squared")
    hinge = ReplyBounds.of_tasks([(X, y)])
    R = float(squared.row_norm[0])
    assert squared.dual_limit(R) == np.inf and squared.dual_limit(0.0) == 0.0
    assert hinge.dual_limit(R) == R
