"""Mini-batch SGD (the MOCHA paper's Mb-SGD baseline) with its ClientApp, run in-process.

* parity: the federation computes bit for bit what a Flower-free loop over the core functions
  (:mod:`fmtl_flower.core.baselines`) computes with the same orders, budgets and drops;
* convergence: the primal decreases and reaches MOCHA's optimum (Omega = I) within a few %;
* faults (design decision 8): every bad or missing reply is logged and counted as a dropped
  node (no loss term that round), exactly as if the reply had never been sent;
* a node that never replies is reported, and the client handlers themselves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.centralized import evaluate_models, fit_mocha
from fmtl_flower.clients.mbsgd import make_mbsgd_client_app
from fmtl_flower.clients.mocha import make_mocha_client_app
from fmtl_flower.core.baselines import (
    mbsgd_local_gradient,
    mbsgd_objective,
    mbsgd_radius,
    mbsgd_server_step,
    mbsgd_step_size,
)
from fmtl_flower.core.decoupling import OutlierWatch
from fmtl_flower.core.formulations import make_formulation
from fmtl_flower.core.losses import LOSSES
from fmtl_flower.core.mocha import omega_step_due
from fmtl_flower.core.rng import coordinate_order
from fmtl_flower.engine import FIRST_NODE_ID, InProcessGrid, run_inprocess
from fmtl_flower.strategies.mbsgd import MbSGD
from fmtl_flower.systems.heterogeneity import drop_mask, local_budgets
from fmtl_flower.systems.timing import round_time
from fmtl_flower.wire import from_array, to_array

from .helpers import ClientCallable, Problem, is_train, make_problem, msg_round, with_metrics

TARGET_TASK = 1
TARGET_NODE = FIRST_NODE_ID + TARGET_TASK  # node i serves partition (task) i by default
FAULT_ROUND = 3
FAULT_RUN = {"omega": "identity", "lam": 0.05, "local_frac": 0.5, "seed": 1}
FAULT_ROUNDS = 5


@pytest.fixture(scope="module")
def problem() -> Problem:
    """``make_synthetic_tasks(num_tasks=5, dim=5, samples_per_task=30, seed=0)``, 75/25 split."""
    return make_problem(num_tasks=5, dim=5, samples_per_task=30, seed=0)


@pytest.fixture(autouse=True, scope="module")
def compiled_mbsgd_kernel() -> None:
    """Compile (or load) the Mb-SGD kernel once, so no timed ClientApp call pays for it."""
    mbsgd_local_gradient(np.eye(3), np.ones(3), np.zeros(3), budget=3,
                         order=coordinate_order(0, 0, 1, 3))


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ------------------------------------------------------------------------------ running
@dataclass
class Run:
    strategy: MbSGD
    grid: InProcessGrid

    @property
    def rounds(self) -> list[dict[str, Any]]:
        return self.strategy.results()["rounds"]

    @property
    def final(self) -> dict[str, Any]:
        return self.strategy.results()["final"]


def run_federation(problem: Problem, num_rounds: int, *,
                   wrap: Callable[[ClientCallable], ClientCallable] | None = None,
                   timeout: float = 60.0, discovery_timeout: float = 5.0,
                   **strategy_kwargs: Any) -> Run:
    """A fresh Mb-SGD ClientApp (wrapped by ``wrap``) and a ServerApp calling ``start``."""
    app = make_mbsgd_client_app(problem.load)
    client = wrap(app) if wrap is not None else app
    min_tasks = strategy_kwargs.pop("min_tasks", None)
    strategy = MbSGD(problem.num_tasks, discovery_timeout=discovery_timeout, **strategy_kwargs)
    if min_tasks is not None:
        strategy.min_tasks = min_tasks
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=num_rounds, timeout=timeout)

    grid = run_inprocess(server_app, client, problem.num_tasks)
    return Run(strategy, grid)


@dataclass
class Reference:
    """States of the Flower-free loop: W and K after k = 0 .. R rounds, per-round counts."""

    Ws: list[np.ndarray]
    Ks: list[np.ndarray]
    counts: list[np.ndarray]
    steps: list[float]

    def primal(self, problem: Problem, k: int) -> float:
        return mbsgd_objective(problem.train(), self.Ws[k], self.Ks[k])


def reference_run(problem: Problem, num_rounds: int, *, lam: float, omega: str = "identity",
                  omega_every: int = 0, beta: float | None = None, schedule: str = "inv",
                  project: bool = True, local_frac: float = 1.0, sys_het: str = "none",
                  sys_het_base: str = "n_min", drop_prob: float = 0.0, seed: int = 0,
                  lost: frozenset[tuple[int, int]] = frozenset(), loss: str = "hinge",
                  **formulation_options: Any) -> Reference:
    """Mb-SGD by direct calls of the core functions; ``lost`` = {(round, task)} not applied."""
    tasks = problem.train()
    m, d = problem.num_tasks, problem.dim
    n = np.array([len(y) for _, y in tasks], dtype=np.int64)
    if "clusters" in formulation_options:  # the strategy's name for make_formulation's k
        formulation_options["k"] = formulation_options.pop("clusters")
    formulation = make_formulation(omega, m, lam=lam, **formulation_options)

    def constants() -> tuple[np.ndarray, float, float | None]:
        K = formulation.regulariser_matrix()
        scale = beta if beta is not None else 1.0 / float(np.linalg.eigvalsh(K)[0])
        dual_max = LOSSES[loss].dual_range[1]
        return K, scale, (mbsgd_radius(K, dual_max) if project else None)

    K, scale, radius = constants()
    W = np.zeros((d, m))
    ref = Reference([W], [K], [], [])
    for r in range(1, num_rounds + 1):
        budgets = np.minimum(local_budgets(n, local_frac=local_frac, sys_het=sys_het,
                                           base=sys_het_base, seed=seed, server_round=r), n)
        dropped = drop_mask(m, drop_prob, seed=seed, server_round=r)
        G, counts = np.zeros((d, m)), np.zeros(m, dtype=np.int64)
        for t, (X, y) in enumerate(tasks):
            if dropped[t] or (r, t) in lost:
                continue
            G[:, t], counts[t] = mbsgd_local_gradient(
                X, y, W[:, t], budget=int(budgets[t]),
                order=coordinate_order(seed, t, r, int(n[t])), loss=loss)
        step = mbsgd_step_size(r, beta=scale, schedule=schedule)
        W = mbsgd_server_step(W, G, K, counts=counts, step=step, radius=radius)
        if omega_step_due(r, omega_every, num_rounds):
            formulation.omega_step(W)
            K, scale, radius = constants()
        ref.Ws.append(W)
        ref.Ks.append(K)
        ref.counts.append(counts)
        ref.steps.append(step)
    return ref


# ------------------------------------------------------------------------------ parity
PARITY_CASES = {
    "identity-full-batch": {"omega": "identity", "lam": 0.05},
    "mean-minibatch-inv-sqrt": {"omega": "mean", "lam": 0.1, "lam2": 0.05, "local_frac": 0.3,
                                "schedule": "inv_sqrt", "beta": 2.0},
    "probabilistic-every-4-drops": {"omega": "probabilistic", "omega_every": 4, "lam": 0.02,
                                    "sys_het": "high", "drop_prob": 0.3},
    "clustered-no-projection": {"omega": "clustered", "eta": 0.5, "clusters": 2, "lam": 0.1,
                                "omega_every": 3, "project": False, "sys_het": "low",
                                "sys_het_base": "n_t"},
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_federation_is_bit_identical_to_the_reference_loop(problem, case):
    kwargs: dict[str, Any] = {"seed": 7, **PARITY_CASES[case]}
    rounds = 12
    run = run_federation(problem, rounds, eval_every=3, **kwargs)
    ref = reference_run(problem, rounds, **kwargs)
    assert np.array_equal(run.strategy.W, ref.Ws[-1])
    assert np.array_equal(run.strategy.K, ref.Ks[-1])
    records = run.rounds
    assert [r["round"] for r in records] == list(range(rounds + 1))
    for k, record in enumerate(records):
        assert record["dual"] is None and record["gap"] is None
        assert record["tasks_missing"] == []
        np.testing.assert_allclose(record["primal"], ref.primal(problem, k), rtol=1e-12)
        if k % 3 == 0 or k == rounds:  # eval_every = 3, and the final state
            expected = evaluate_models(ref.Ws[k], problem.test())
            assert record["test_error"] == expected["test_error"]
            assert record["accuracy_bottom_decile"] == expected["accuracy_bottom_decile"]
        else:
            assert record["test_error"] is None
        if k == 0:
            continue
        counts = ref.counts[k - 1]
        assert record["num_replies"] == problem.num_tasks
        assert record["num_dropped"] == int(np.sum(counts == 0))
        assert record["samples"] == int(counts.sum())
        assert record["step_size"] == ref.steps[k - 1]
        assert record["omega_step"] == omega_step_due(k, kwargs.get("omega_every", 0), rounds)
        assert record["estimated_time_s"] == round_time(counts, problem.dim, "mb-sgd", "lte")
    if kwargs.get("drop_prob", 0.0) > 0:  # the drop path is exercised
        assert any(r["num_dropped"] for r in records[1:])
    final = run.final
    assert final["complete"] and final["tasks_never_replied"] == []
    assert final["round"] == rounds


@pytest.mark.parametrize("loss", ["smoothed-hinge", "logistic", "squared"])
def test_a_loss_other_than_the_hinge_trains_as_the_reference_loop_with_its_derivative(
        problem, loss):
    """``mocha.loss`` for Mb-SGD: the devices step with the loss's derivative (sent in the
    config), the server bounds |grad| by the loss's sup |l'| (the squared loss's exceeds
    the hinge's count R: no honest reply is rejected), projects on the ball of its max D and
    times the loss's gradient FLOPs; W is the reference loop's bit for bit and the primal is
    the loss's."""
    kwargs: dict[str, Any] = {"seed": 7, "omega": "mean", "lam": 0.1, "lam2": 0.05,
                              "local_frac": 0.5, "loss": loss}
    rounds = 6
    run = run_federation(problem, rounds, **kwargs)
    ref = reference_run(problem, rounds, **kwargs)
    assert np.array_equal(run.strategy.W, ref.Ws[-1])
    assert run.strategy.radius == mbsgd_radius(run.strategy.K, LOSSES[loss].dual_range[1])
    own = LOSSES[loss]
    for k, record in enumerate(run.rounds):
        W = ref.Ws[k]
        primal = sum(own.mean_value(X, y, W[:, t]) for t, (X, y) in enumerate(problem.train()))
        primal += 0.5 * float(np.einsum("ij,ij->", W @ ref.Ks[k], W))
        assert record["primal"] == pytest.approx(primal, rel=1e-12)
        if k:
            assert record["num_dropped"] == 0
            assert record["estimated_time_s"] == round_time(ref.counts[k - 1], problem.dim,
                                                            "mb-sgd", "lte", loss=loss)
    assert run.final["complete"]
    hinge = run_federation(problem, rounds, **{**kwargs, "loss": "hinge"})
    assert not np.array_equal(hinge.strategy.W, run.strategy.W)


@pytest.mark.parametrize("loss", ["hinge", "squared"])
def test_the_outlier_watch_measures_a_gradient_against_its_losss_bound(problem, loss,
                                                                        monkeypatch):
    """Robust mode's watch gets each task's |grad| bound count R sup |l'| at |z| <= R |w_t|
    (R the federation's scale): count R for the hinge, as before; more for the squared loss,
    whose honest gradients exceed count R (else every task would look like an outlier)."""
    calls = []
    run_kwargs = {"seed": 7, "omega": "mean", "lam": 0.1, "lam2": 0.05, "loss": loss}
    original = OutlierWatch.update

    def spy(self, step, step_bound, image, *args, **kwargs):
        calls.append((step.copy(), np.array(step_bound, dtype=float), image.copy(), args[0]))
        return original(self, step, step_bound, image, *args, **kwargs)

    monkeypatch.setattr(OutlierWatch, "update", spy)
    run_federation(problem, 4, **run_kwargs)
    assert len(calls) == 4
    n = np.array([len(y) for _, y in problem.train()])  # local_frac 1: count = n-train
    for _, step_bound, w_norm, inv_scale in calls:
        scale = 1.0 / inv_scale
        slope = LOSSES[loss].derivative_bound(scale * w_norm)
        np.testing.assert_array_equal(step_bound, n * scale * slope)
        if loss == "hinge":
            assert np.all(slope == 1.0)
    if loss == "squared":  # the hinge's bound count R would be exceeded
        assert max(float(np.max(step * inv / n)) for step, _, _, inv in calls) > 1.0


@pytest.mark.parametrize("loss", ["hinge", "smoothed-hinge", "logistic", "squared"])
def test_the_minibatch_gradient_is_the_losss_derivative(loss):
    """mbsgd_local_gradient's sum is the gradient of sum_S l(y x^T w) (central differences
    away from kinks); the hinge's compiled kernel and the generic formula agree."""
    rng = np.random.default_rng(3)
    X, y = rng.normal(size=(40, 4)), rng.choice([-1.0, 1.0], size=40)
    w = rng.normal(size=4)
    order = rng.permutation(40)
    g, count = mbsgd_local_gradient(X, y, w, budget=25, order=order, loss=loss)
    idx = order[:25]
    l = LOSSES[loss]

    def total(v):
        return float(l.value(y[idx] * (X[idx] @ v)).sum())

    h = 1e-6
    numeric = np.array([(total(w + h * e) - total(w - h * e)) / (2 * h) for e in np.eye(4)])
    assert count == 25
    np.testing.assert_allclose(g, numeric, rtol=1e-6, atol=1e-6)
    generic = (y[idx] * l.derivative(y[idx] * (X[idx] @ w))) @ X[idx]
    np.testing.assert_allclose(g, generic, rtol=1e-12, atol=1e-12)


def test_default_step_scale_and_radius():
    strategy = MbSGD(4, lam=0.1, omega="mean", lam2=0.02)
    K = make_formulation("mean", 4, lam=0.1, lam2=0.02).regulariser_matrix()
    lam_min = float(np.linalg.eigvalsh(K)[0])
    assert lam_min == pytest.approx(0.02)  # K = lam Omega + lam2 I has eigenvalue lam2 on 1
    assert strategy.step_scale == 1.0 / lam_min  # Pegasos: beta = 1 / lambda_min(K)
    assert strategy.radius == mbsgd_radius(K)
    assert MbSGD(4, lam=0.1, beta=3.0).step_scale == 3.0
    assert MbSGD(4, lam=0.1, project=False).radius is None


@pytest.mark.parametrize("kwargs", [
    {"lam": 0.0}, {"lam": float("nan")}, {"omega": "bogus"}, {"omega": "mean"},
    {"beta": 0.0}, {"beta": float("inf")}, {"schedule": "linear"}, {"project": 1},
    {"local_frac": 1.5}, {"local_frac": 0.0}, {"sys_het": "extreme"}, {"drop_prob": 1.0},
    {"network": "5g"}, {"omega_every": -1}, {"eval_every": 0},
])
def test_constructor_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        MbSGD(3, **{"lam": 0.1, **kwargs})


# ------------------------------------------------------------------------------ convergence
CONV_LAM = 0.05
CONV_ROUNDS = 200


@pytest.fixture(scope="module")
def mocha_optimum(problem) -> float:
    """P* of the W-step (Omega = I) from MOCHA run to a duality gap of ~0."""
    fit = fit_mocha(problem.train(), lam=CONV_LAM, rounds=300, omega="identity", omega_every=0)
    final = fit.history[-1]
    assert abs(final["gap"]) < 1e-10 * final["primal"]
    return final["primal"]


@pytest.mark.parametrize(("local_frac", "tolerance"), [(1.0, 1e-3), (0.5, 0.01)])
def test_primal_decreases_to_mochas_optimum(problem, mocha_optimum, local_frac, tolerance):
    run = run_federation(problem, CONV_ROUNDS, omega="identity", lam=CONV_LAM,
                         local_frac=local_frac, eval_every=50)
    primal = np.array([r["primal"] for r in run.rounds])
    assert np.all(primal >= mocha_optimum * (1 - 1e-12))  # P* is the minimum
    # Stochastic subgradient steps are not monotone (on the synthetic draw of issue 19 the
    # primal at round 50 is 0.03 % above round 20's with local_frac 0.5): the best primal so
    # far must improve between every two checkpoints.
    best = np.minimum.accumulate(primal)[[0, 5, 20, 50, 100, CONV_ROUNDS]]
    assert np.all(np.diff(best) < 0), best
    suboptimality = (primal[-1] - mocha_optimum) / mocha_optimum
    assert suboptimality < tolerance, suboptimality
    assert run.final["complete"]
    assert run.final["test_error"] is not None


# ------------------------------------------------------------------------------ faults
def _with_grad(reply: Message, msg: Message, grad: np.ndarray) -> Message:
    return with_metrics(reply, msg, ArrayRecord({"grad": to_array(grad)}))


def corrupt(kind: str, app: ClientCallable, msg: Message, context: Context) -> Message:
    """Run the real ClientApp (unless it 'crashes'), then break its reply in one way."""
    if kind == "raise":
        raise RuntimeError("injected crash")
    reply = app(msg, context)
    grad = from_array(reply.content["arrays"]["grad"])
    count = int(reply.content["metrics"]["count"])
    if kind == "nan":
        bad = grad.copy()
        bad[1] = np.nan
        return _with_grad(reply, msg, bad)
    if kind == "inf":
        return _with_grad(reply, msg, np.full_like(grad, np.inf))
    if kind == "wrong-shape":
        return _with_grad(reply, msg, np.zeros(grad.shape[0] + 1))
    if kind == "wrong-dtype":
        return _with_grad(reply, msg, grad.astype(np.float32))
    if kind == "missing-grad":
        return with_metrics(reply, msg, ArrayRecord({"g": to_array(grad)}))
    if kind == "missing-metrics":
        return Message(RecordDict({"arrays": reply.content["arrays"]}), reply_to=msg)
    if kind == "count-over-budget":
        return with_metrics(reply, msg, count=int(msg.content["config"]["budget"]) + 1)
    if kind == "count-float":
        return with_metrics(reply, msg, count=float(count))
    if kind == "count-missing":
        return with_metrics(reply, msg, count=None)
    if kind == "zero-count-nonzero-grad":
        return with_metrics(reply, msg, count=0)
    if kind == "negative-loss":
        return with_metrics(reply, msg, **{"loss-mean": -0.5})
    if kind == "wrong-round":
        return with_metrics(reply, msg, round=msg_round(msg) - 1)
    if kind == "wrong-task":
        return with_metrics(reply, msg, **{"task-id": TARGET_TASK + 1})
    if kind == "wrong-n":
        return with_metrics(reply, msg, **{"n-train": int(reply.content["metrics"]["n-train"])
                                           + 1})
    if kind == "error-reply":
        return Message(Error(code=0, reason="injected error reply"), reply_to=msg)
    raise ValueError(kind)


def fault_at(kind: str, node: int, rounds: set[int]) -> Callable[[ClientCallable],
                                                                  ClientCallable]:
    def wrap(app: ClientCallable) -> ClientCallable:
        def client(msg: Message, context: Context) -> Message:
            if context.node_id == node and is_train(msg) and msg_round(msg) in rounds:
                return corrupt(kind, app, msg, context)
            return app(msg, context)

        return client

    return wrap


FAULTS = {
    "raise": "RuntimeError: injected crash",
    "error-reply": "injected error reply",
    "nan": "non-finite",
    "inf": "non-finite",
    "wrong-shape": "shape",
    "wrong-dtype": "float64",
    "missing-grad": "array 'g' is not in the wire contract",  # ('grad' replaced by 'g')
    "missing-metrics": "no 'metrics'",
    "count-over-budget": "count",
    "count-float": "'count' must be an int",
    "count-missing": "'count' missing",
    "zero-count-nonzero-grad": "zero when count is 0",
    "negative-loss": "loss-mean",
    "wrong-round": "expected task 1 round 3",
    "wrong-task": "expected task 1 round 3",
    "wrong-n": "n-train",
}


@pytest.mark.parametrize("kind", list(FAULTS))
def test_bad_reply_is_logged_and_counted_as_dropped(problem, caplog, kind):
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run = run_federation(problem, FAULT_ROUNDS, wrap=fault_at(kind, TARGET_NODE,
                                                                  {FAULT_ROUND}), **FAULT_RUN)
    warnings = warnings_of(caplog)
    assert len(warnings) == 1, warnings
    assert f"round {FAULT_ROUND}" in warnings[0] and FAULTS[kind] in warnings[0], warnings
    # exactly the run in which that reply never came: no loss term of task 1 in round 3
    ref = reference_run(problem, FAULT_ROUNDS, lost=frozenset({(FAULT_ROUND, TARGET_TASK)}),
                        **FAULT_RUN)
    assert np.array_equal(run.strategy.W, ref.Ws[-1])
    records = run.rounds
    # round 3's replies complete the record of the state after round 2
    assert records[FAULT_ROUND - 1]["tasks_missing"] == [TARGET_TASK]
    assert records[FAULT_ROUND - 1]["primal"] is None
    assert records[FAULT_ROUND]["num_replies"] == problem.num_tasks - 1
    assert records[FAULT_ROUND]["num_dropped"] == 1
    for k, record in enumerate(records):
        if k != FAULT_ROUND - 1:
            np.testing.assert_allclose(record["primal"], ref.primal(problem, k), rtol=1e-12)
    assert run.final["complete"] and run.final["tasks_never_replied"] == []


def test_late_reply_is_dropped_and_the_round_lasts_the_timeout(problem, caplog):
    timeout = 0.25

    def wrap(app: ClientCallable) -> ClientCallable:
        def client(msg: Message, context: Context) -> Message:
            reply = app(msg, context)
            if context.node_id == TARGET_NODE and is_train(msg) and msg_round(msg) == 2:
                time.sleep(timeout + 0.1)
            return reply

        return client

    with caplog.at_level(logging.WARNING, logger="flwr"):
        run = run_federation(problem, 3, wrap=wrap, timeout=timeout, **FAULT_RUN)
    assert any("round 2: no reply from task 1" in w for w in warnings_of(caplog))
    records = run.rounds
    assert records[1]["tasks_missing"] == [TARGET_TASK]
    assert records[2]["estimated_time_s"] == timeout
    assert records[1]["estimated_time_s"] < timeout  # ~ one LTE round trip
    ref = reference_run(problem, 3, lost=frozenset({(2, TARGET_TASK)}), **FAULT_RUN)
    assert np.array_equal(run.strategy.W, ref.Ws[-1])


@pytest.mark.parametrize("how", ["silent", "whoami-only"])
def test_node_that_never_replies_is_reported(problem, caplog, how):
    silent_task = 4
    node = FIRST_NODE_ID + silent_task
    rounds = 6

    def wrap(app: ClientCallable) -> ClientCallable:
        def client(msg: Message, context: Context) -> Message:
            if context.node_id == node and (how == "silent"
                                            or "whoami" not in msg.metadata.message_type):
                raise ConnectionError("node down")
            return app(msg, context)

        return client

    with caplog.at_level(logging.WARNING, logger="flwr"):
        run = run_federation(problem, rounds, wrap=wrap, discovery_timeout=0.3,
                             min_tasks=problem.num_tasks - 1, **FAULT_RUN)
    final = run.final
    assert final["tasks_never_replied"] == [silent_task]
    assert final["complete"] is False and final["primal"] is None
    assert len(run.rounds) == rounds + 1
    assert all(r["tasks_missing"] == [silent_task] and r["primal"] is None for r in run.rounds)
    warnings = warnings_of(caplog)
    if how == "silent":
        assert any("running without task ids 4" in w for w in warnings), warnings
        assert any("whoami failed on node 1005" in w for w in warnings), warnings
    else:
        assert any("node 1005 failed: ConnectionError: node down" in w for w in warnings)
    # the others train as if task 4 had dropped every round; W[:, 4] stays 0 (Omega = I)
    lost = frozenset((r, silent_task) for r in range(1, rounds + 1))
    ref = reference_run(problem, rounds, lost=lost, **FAULT_RUN)
    assert np.array_equal(run.strategy.W, ref.Ws[-1])
    assert np.all(run.strategy.W[:, silent_task] == 0.0)


def test_on_round_sees_every_completed_record(problem):
    seen: list[dict[str, Any]] = []
    run = run_federation(problem, 4, on_round=seen.append, **FAULT_RUN)
    assert seen == run.rounds
    assert all(not any(k.startswith("_") for k in r) for r in seen)


# ------------------------------------------------------------------------------ client
def _context(node_config: dict[str, Any]) -> Context:
    return Context(run_id=987654, node_id=42, node_config=node_config, state=RecordDict(),
                   run_config={})


def _train_message(w: np.ndarray, **config: Any) -> Message:
    base = {"task-id": 2, "server-round": 5, "budget": 7, "seed": 3, "dropped": False,
            "eval": True}
    content = RecordDict({"arrays": ArrayRecord({"w": to_array(w)}),
                          "config": ConfigRecord({**base, **config})})
    return Message(content, dst_node_id=42, message_type=MessageType.TRAIN)


def test_client_train_sends_the_minibatch_subgradient(problem):
    app = make_mbsgd_client_app(problem.load)
    context = _context({"partition-id": 2})
    X, y = problem.Xs[2], problem.ys[2]
    w = np.linspace(-0.4, 0.5, problem.dim)
    reply = app(_train_message(w), context)
    expected, count = mbsgd_local_gradient(X, y, w, budget=7,
                                           order=coordinate_order(3, 2, 5, len(y)))
    grad = from_array(reply.content["arrays"]["grad"])
    assert grad.dtype == np.float64 and np.array_equal(grad, expected)
    metrics = reply.content["metrics"]
    assert (metrics["task-id"], metrics["round"], metrics["count"]) == (2, 5, count)
    assert metrics["n-train"] == len(y)
    assert metrics["loss-mean"] == pytest.approx(np.maximum(0, 1 - y * (X @ w)).mean())
    assert metrics["test-n"] == len(problem.yt[2])
    assert len(context.state) == 0  # a primal method keeps no device state

    dropped = app(_train_message(w, dropped=True), context)
    assert dropped.content["metrics"]["count"] == 0
    assert not np.any(from_array(dropped.content["arrays"]["grad"]))

    evaluated = app(Message(RecordDict({"arrays": ArrayRecord({"w": to_array(w)}),
                                        "config": ConfigRecord({"task-id": 2,
                                                                "server-round": 9,
                                                                "eval": True})}),
                            dst_node_id=42, message_type=MessageType.EVALUATE), context)
    assert "arrays" not in evaluated.content or not evaluated.content["arrays"]
    assert evaluated.content["metrics"]["loss-mean"] == metrics["loss-mean"]
    assert evaluated.content["metrics"]["test-errors"] == metrics["test-errors"]


def test_client_whoami_is_mochas(problem):
    query = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=42,
                    message_type=f"{MessageType.QUERY}.whoami")
    ours = make_mbsgd_client_app(problem.load)(query, _context({"task-id": 3}))
    mochas = make_mocha_client_app(problem.load)(query, _context({"task-id": 3}))
    assert dict(ours.content["info"]) == dict(mochas.content["info"])


@pytest.mark.parametrize("config", [{"budget": 10_000}, {"budget": -1}, {"task-id": 1},
                                    {"budget": 2.0}, {"dropped": 0}])
def test_client_rejects_bad_instructions(problem, config):
    app = make_mbsgd_client_app(problem.load)
    # the handler raises; a Flower engine turns that into an error reply (see the fault tests)
    with pytest.raises(ValueError):
        app(_train_message(np.zeros(problem.dim), **config), _context({"partition-id": 2}))
