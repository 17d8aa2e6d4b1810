"""Adding a loss is one class: a toy loss written here in Python/numpy, registered with one
call, runs MOCHA end to end (the federation's devices, the server's bounds and certificate)
to a certified duality gap at the optimum an independent solver finds, with no kernel edited.

The toy is the squared hinge l(z) = max(0, 1 - z)^2 / 2 (not one of the built-in losses).
Its conjugate: for a >= 0, sup_z (-a z - l(z)) is reached at z = 1 - a, so
D(a) = -l*(-a) = a - a^2 / 2 on [0, inf) (D's maximum 1/2 at a = 1), and the SDCA step
max_a D(a) - z (a - a_old) - (q/2)(a - a_old)^2 over a >= 0 is
a = max(0, a_old + (1 - z - a_old) / (1 + q)).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import minimize

from fmtl_flower.core import jit
from fmtl_flower.core.formulations import make_formulation
from fmtl_flower.core.losses import (
    LOSSES,
    Loss,
    _check_fenchel_young,
    get_loss,
    register_loss,
    unregister_loss,
)
from fmtl_flower.core.record_dp import record_contribution
from fmtl_flower.core.sdca import sdca_local_update
from fmtl_flower.core.svm import fit_linear_svm
from fmtl_flower.settings import MOCHASettings
from fmtl_flower.systems.timing import local_flops

from ..strategies.helpers import make_problem, run_federation

TARGET = 1e-4
MEAN = {"omega": "mean", "lam": 1e-2, "lam2": 1e-1, "omega_every": 0}


class SquaredHinge(Loss):
    """l(z) = max(0, 1 - z)^2 / 2: the whole of the new loss (module docstring)."""

    name = "toy-squared-hinge"
    peak = 1.0
    dual_domain = (0.0, math.inf)
    dual_range = (-math.inf, 0.5)
    smoothness = 1.0

    def value(self, margins):
        r = np.maximum(0.0, 1.0 - np.asarray(margins, dtype=np.float64))
        return 0.5 * r * r

    def dual(self, a):
        a = np.asarray(a, dtype=np.float64)
        return a - 0.5 * a * a

    def value_bound(self, margin_bound):
        return 0.5 * (1.0 + margin_bound) ** 2

    def sdca_step(self, a_old, z, q):
        return max(0.0, a_old + (1.0 - z - a_old) / (1.0 + q))


@pytest.fixture(scope="module")
def toy():
    loss = register_loss(SquaredHinge())  # the one call; removed after (a shared registry)
    yield loss
    unregister_loss(loss.name)


def _primal_and_gradient(tasks, K, W):
    """P(W) = sum_t mean_i l(y x^T w_t) + (1/2) tr(W K W^T) and its gradient, with the squared
    hinge written out again (l' = -max(0, 1 - z)), apart from the class under test."""
    total, grad = 0.0, W @ K
    for t, (X, y) in enumerate(tasks):
        r = np.maximum(0.0, 1.0 - y * (X @ W[:, t]))
        total += float((0.5 * r * r).mean())
        grad[:, t] -= X.T @ (y * r) / X.shape[0]
    return total + 0.5 * float(np.einsum("ij,ij->", W @ K, W)), grad


def _lbfgs_optimum(tasks, K):
    d, m = tasks[0][0].shape[1], len(tasks)

    def fun(x):
        value, grad = _primal_and_gradient(tasks, K, x.reshape(d, m))
        return value, grad.ravel()

    res = minimize(fun, np.zeros(d * m), jac=True, method="L-BFGS-B",
                   options={"maxiter": 100000, "maxfun": 200000, "maxcor": 30,
                            "ftol": 1e-15, "gtol": 1e-11})
    return float(res.fun), res.x.reshape(d, m)


def test_mocha_federation_certifies_the_gap_of_a_toy_loss_at_the_lbfgs_optimum(toy):
    """Omega fixed (``mean``: the tasks coupled): the devices train the toy loss they read
    from the message, the record's certified relative gap reaches 1e-4 with no certificate
    rejection, its primal is the toy's P of the server's W, and W is scipy's optimum."""
    problem = make_problem(num_tasks=5, dim=4, samples_per_task=24, seed=3)
    run = run_federation(problem, 80, loss=toy.name, **MEAN)
    final = run.final
    assert final["gap_certified"] and final["certificate_rejections_total"] == 0
    assert final["gap"] <= TARGET * final["primal"]
    s = MOCHASettings(loss=toy.name, **MEAN)
    K = make_formulation(s.omega, problem.num_tasks, lam=s.lam,
                         **s.formulation_options).regulariser_matrix()
    W = run.strategy.state.W
    own, _ = _primal_and_gradient(problem.train(), K, W)
    assert final["primal"] == pytest.approx(own, rel=1e-10)
    best, W_star = _lbfgs_optimum(problem.train(), K)
    assert final["dual"] <= best * (1 + 1e-9) and best <= final["primal"] * (1 + 1e-9)
    assert abs(final["primal"] - best) <= TARGET * best
    # strong convexity (K >= lam2 I): |W - W*|_F^2 <= 2 (P(W) - P*) / lam2
    assert np.linalg.norm(W - W_star) ** 2 <= 2 * final["gap"] / MEAN["lam2"] + 1e-9


def test_a_toy_loss_runs_numpy_whatever_the_kernel_mode(toy):
    """No kernel compiles the toy's code: under ``FMTL_KERNELS=numba`` its SDCA runs the numpy
    implementation (the same numbers as under ``numpy``), and those are the toy's own steps,
    not a built-in loss's (the hinge's and the squared loss's differ from them here)."""
    rng = np.random.default_rng(5)
    X = rng.standard_normal((40, 3))
    X[7] = 0.0  # a zero row: the toy's peak
    y = np.where(rng.standard_normal(40) > 0, 1.0, -1.0)
    args = dict(budget=120, m_tt=1.5, sigma_prime=2.0, order=rng.permutation(40))
    w = rng.standard_normal(3)
    with jit.using("numpy"):
        numpy_run = sdca_local_update(X, y, np.zeros(40), w, loss=toy, **args)
    with jit.using("numba"):
        numba_mode = sdca_local_update(X, y, np.zeros(40), w, loss=toy, **args)
    for ours, theirs in zip(numpy_run, numba_mode, strict=True):
        np.testing.assert_array_equal(ours, theirs)
    a = y * numpy_run[0]
    assert a.min() >= 0.0 and a.max() > 1.0  # the toy's domain [0, inf), not the hinge's box
    assert a[7] == 1.0
    for other in ("hinge", "squared"):
        with jit.using("numpy"):
            assert not np.allclose(sdca_local_update(X, y, np.zeros(40), w, loss=other,
                                                     **args)[0], numpy_run[0])


@pytest.mark.parametrize("method", ["cocoa", "mb-sdca"])
def test_the_baseline_local_solvers_train_a_toy_loss_with_a_certified_gap(toy, method):
    """CoCoA's local solver (SDCA blocks between local-gap checks) and Mb-SDCA's (every step
    at the stale model) run the toy's numpy steps in a federation: every round's gap is
    certified and non-negative, and it falls."""
    problem = make_problem(num_tasks=4, dim=4, samples_per_task=20, seed=2)
    run = run_federation(problem, 40, loss=toy.name, method=method, omega="identity",
                         lam=0.05, omega_every=0, beta=4.0)
    gaps = [r["gap"] for r in run.rounds if r.get("gap") is not None]
    assert run.final["gap_certified"] and all(g >= -1e-12 for g in gaps)
    assert gaps[-1] < 0.05 * gaps[0]


def test_the_single_task_svm_solver_fits_a_toy_loss_to_its_certified_gap(toy):
    """The ``local`` / ``global`` baselines' solver (a compiled epoch loop: it runs as Python
    over the toy's pieces) reaches its relative gap, at scipy's optimum of the same primal."""
    problem = make_problem(num_tasks=1, dim=4, samples_per_task=60, seed=9)
    (X, y), = problem.train()
    c = 0.05
    with jit.using("numba"):
        w, rel_gap = fit_linear_svm(X, y, c, tol=1e-8, max_epochs=2000, loss=toy)
    assert rel_gap <= 1e-8
    best, w_star = _lbfgs_optimum([(X, y)], np.array([[c]]))
    own, _ = _primal_and_gradient([(X, y)], np.array([[c]]), w[:, None])
    assert abs(own - best) <= 1e-8 * best
    assert np.linalg.norm(w - w_star.ravel()) ** 2 <= 2 * rel_gap * own / c + 1e-12


def test_barrier_free_mocha_certifies_a_toy_loss_at_the_lbfgs_optimum(toy):
    """Asynchronous MOCHA (4 of 6 coupled tasks in flight, stale replies, the safeguard's
    partial steps on the toy's curved dual term) stops at a certified 1e-7 relative gap, at
    scipy's optimum of the toy's primal."""
    from fmtl_flower.core.async_mocha import simulate_async_mocha

    from .async_problems import coupled_tasks

    tasks = coupled_tasks()
    run = simulate_async_mocha(tasks, np.linspace(1.0, 3.0, 6), lam=0.05, omega="mean",
                               formulation_options={"lam2": 0.01}, replies=6 * 1500,
                               concurrency=4, tau=5, latency_sigma=1.0, seed=4, loss=toy,
                               stop_relative_gap=1e-7)
    assert max(r["staleness"] for r in run.records) > 0
    assert any(0.0 < r.get("gamma", 1.0) < 1.0 for r in run.records)
    last = [r for r in run.records if r["gap"] is not None][-1]
    assert 0.0 <= last["gap"] <= 1e-7 * last["primal"]
    K = make_formulation("mean", len(tasks), lam=0.05, lam2=0.01).regulariser_matrix()
    best, _ = _lbfgs_optimum(tasks, K)
    assert last["dual"] <= best * (1 + 1e-9) and best <= last["primal"] * (1 + 1e-9)
    assert abs(last["primal"] - best) <= 1e-7 * best


def _fmtl_run(values: dict) -> dict:
    """The results of a run of the run-config ``values`` through ``fmtl run``'s apps
    (in-process engine)."""
    from fmtl_flower.apps.common import make_client_app, make_server_app
    from fmtl_flower.config import RunConfig
    from fmtl_flower.engine import run_inprocess

    cfg = RunConfig.from_mapping(values)
    box: dict = {}
    run_inprocess(make_server_app(cfg, on_done=box.update), make_client_app(cfg),
                  math.ceil(cfg.num_tasks / cfg.tasks_per_node))
    return box


def test_the_run_config_names_a_toy_loss_and_packed_nodes_train_it_bit_for_bit(toy):
    """``mocha.loss = <the toy's name>`` through the run config and ``fmtl run``'s apps:
    packed nodes (the stacked messages' shared config) train it exactly as one task per node
    does, with a certified gap, and not as the hinge."""
    base = {"strategy": "mocha", "num-tasks": 8, "dim": 5, "samples-per-task": 15,
            "num-server-rounds": 4, "mocha.omega-every": 2, "mocha.drop-prob": 0.2}
    one = _fmtl_run({**base, "mocha.loss": toy.name, "tasks-per-node": 1})
    packed = _fmtl_run({**base, "mocha.loss": toy.name, "tasks-per-node": 4})
    hinge = _fmtl_run({**base, "tasks-per-node": 4})

    def untimed(record):
        return {k: v for k, v in record.items() if not k.endswith("_s")}

    assert [untimed(r) for r in one["rounds"]] == [untimed(r) for r in packed["rounds"]]
    assert untimed(one["final"]) == untimed(packed["final"])
    assert packed["final"]["gap_certified"] and packed["final"]["certificate_rejections_total"] \
        == 0 and packed["final"]["primal"] != hinge["final"]["primal"]


def test_registration_checks_the_loss(toy):
    """The registry takes a loss once, refuses one whose value and dual are no conjugate
    pair (its gap would be certified falsely) or whose step is not the coordinate
    maximiser, and an unregistered instance is refused."""
    assert LOSSES[toy.name] is toy and get_loss(toy.name) is toy
    with pytest.raises(ValueError, match="already registered"):
        register_loss(SquaredHinge())

    class WrongDual(SquaredHinge):
        name = "toy-wrong-dual"

        def dual(self, a):
            return np.asarray(a, dtype=np.float64)  # the hinge's D: too large for this l

    class WrongStep(SquaredHinge):
        name = "toy-wrong-step"

        def sdca_step(self, a_old, z, q):  # the hinge's step: not this D's maximiser
            return 1.0 if q <= 0.0 else min(1.0, max(0.0, a_old + (1.0 - z) / q))

    with pytest.raises(ValueError, match="Fenchel-Young"):
        register_loss(WrongDual())
    with pytest.raises(ValueError, match="not the coordinate maximiser"):
        register_loss(WrongStep())
    with pytest.raises(ValueError, match="not registered"):
        get_loss(WrongDual())
    assert "toy-wrong-dual" not in LOSSES and "toy-wrong-step" not in LOSSES


@pytest.mark.parametrize("name", ["hinge", "smoothed-hinge", "logistic", "squared"])
def test_the_registration_check_accepts_every_built_in_loss(name):
    """The check is not stricter than the losses it models: the four built-in losses pass
    it (their codes aside, nothing distinguishes them from a registered one)."""
    _check_fenchel_young(LOSSES[name])


def test_the_time_model_charges_a_registered_losss_step_flops(toy, monkeypatch):
    """The time model asks the loss for its step's FLOPs: the toy left at the default is
    timed as the hinge; one that declares 20 is charged 12 FLOPs more a step."""
    steps = np.array([0, 10, 1000])
    hinge = local_flops(steps, 7, "mocha")
    np.testing.assert_array_equal(local_flops(steps, 7, "mocha", loss=toy.name), hinge)
    monkeypatch.setattr(toy, "step_flops", 20)
    np.testing.assert_array_equal(local_flops(steps, 7, "mocha", loss=toy), hinge + 12 * steps)


def test_record_dp_bounds_a_registered_losss_step_by_its_dual_slope(toy, monkeypatch):
    """Record-level DP's step bound reads the loss's ``dual_slope``: the toy's D'(a) = 1 - a
    is unbounded on [0, inf), so by default the box C r; a loss declaring a finite slope
    gets the step bound of that slope (here the hinge's, at the same radius)."""
    args = (2.0, 10, 1.0, 1000.0, 0.3)
    assert toy.dual_slope == math.inf
    assert record_contribution(*args, toy.name) == 2.0
    monkeypatch.setattr(toy, "dual_slope", 1.0)
    assert record_contribution(*args, toy) == record_contribution(*args, "hinge") < 2.0


def test_mb_sgd_refuses_a_registered_loss_without_a_derivative(toy):
    """Mb-SGD's step needs l'(z): the toy defines none, so ``mocha.loss`` naming it for
    Mb-SGD is a ConfigError (MOCHA takes it)."""
    from fmtl_flower.settings import ConfigError, MbSGDSettings

    assert MOCHASettings(loss=toy.name).loss == toy.name
    with pytest.raises(ConfigError, match="defines no derivative"):
        MbSGDSettings(loss=toy.name)
