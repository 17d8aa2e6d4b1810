"""FSVRG / naive FSVRG / GD / CoCoA+ / DANE strategies with their ClientApp, run in-process.

* parity: the federation equals a Flower-free loop over :mod:`fmtl_flower.core.fsvrg` bit for
  bit (CoCoA+: the ``fsvrg-fig2`` reproduction's own loop);
* convergence to the scikit-learn optimum; GD decreases the objective monotonically; CoCoA+'s
  dual increases and its duality gap stays >= 0;
* faults: a corrupted local model or ``d_w`` (NaN, wrong shape, wrong round, ...) is rejected
  with a logged reason and the model equals the run in which that node did not take part in
  that round; CoCoA+ nodes roll back, and a node that loses its state is reset, so the server's
  ``w`` always equals ``w(alpha)`` of the nodes' committed dual variables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from scipy.sparse.linalg import svds
from sklearn.linear_model import LogisticRegression

from fmtl_flower.clients.fsvrg import (
    COCOA_STATE_ARRAYS,
    COCOA_STATE_META,
    make_fsvrg_client_app,
)
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.core.fsvrg import (
    GD_POWER_MAX_ITER,
    GD_POWER_TOL,
    cocoa_plus_aggregate,
    cocoa_plus_local_sdca,
    combine_feature_counts,
    dane_aggregate,
    dane_epoch_orders,
    dane_local_solve,
    fsvrg_aggregate,
    fsvrg_local_pass,
    global_gradient,
    global_objective,
    gram_power_start,
    local_loss_grad_sums,
    logistic_objective,
    naive_fsvrg_aggregate,
    naive_fsvrg_local_pass,
    node_feature_counts,
    power_estimate,
    primal_from_dual,
    uniform_sample_order,
)
from fmtl_flower.core.rng import coordinate_order
from fmtl_flower.data.sparse_federated import SparseFederatedDataset, make_sparse_federated
from fmtl_flower.engine import FIRST_NODE_ID, InProcessGrid, run_inprocess
from fmtl_flower.experiments.fsvrg_fig2 import Pooled, run_cocoa_plus
from fmtl_flower.strategies.fsvrg import FSVRG
from fmtl_flower.wire import from_array, to_array

from .helpers import ClientCallable

K = 20
DIM = 500


@pytest.fixture(scope="module")
def data() -> SparseFederatedDataset:
    return make_sparse_federated(num_tasks=K, dim=DIM, seed=0)


def federate(data: SparseFederatedDataset, num_rounds: int,
             wrap: Callable[[ClientCallable], ClientCallable] | None = None,
             **kwargs: Any) -> tuple[FSVRG, InProcessGrid]:
    """``kwargs`` default to ``robust=False``: these tests check the paper's algorithms, and
    on this federation robust mode caps the largest device (1022 of 2147 rows) at
    max-weight-share (tests/strategies/test_byzantine_fsvrg.py covers robust mode)."""
    app = make_fsvrg_client_app(lambda ctx: data.task(default_task_id(ctx)).arrays())
    client = wrap(app) if wrap is not None else app
    strategy = FSVRG(data.num_tasks, discovery_timeout=5.0, **{"robust": False, **kwargs})
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=num_rounds, timeout=60.0)

    return strategy, run_inprocess(server_app, client, data.num_tasks)


def run(data: SparseFederatedDataset, num_rounds: int,
        wrap: Callable[[ClientCallable], ClientCallable] | None = None,
        **kwargs: Any) -> FSVRG:
    return federate(data, num_rounds, wrap, **kwargs)[0]


def reference(data: SparseFederatedDataset, num_rounds: int, *, method: str, lam: float,
              h: float = 0.0, seed: int = 0, skip: frozenset[tuple[int, int]] = frozenset(),
              step: float | None = None, mu: float = 0.0, epochs: int = 1
              ) -> list[np.ndarray]:
    """The same algorithm by direct core calls; ``skip`` = {(round, task)} local models lost."""
    tasks = [data.task(t) for t in range(data.num_tasks)]
    counts = [node_feature_counts(t.X_train) for t in tasks]
    stats = combine_feature_counts(counts)
    n = stats.n
    w = np.zeros(data.dim)
    ws = [w]
    for r in range(1, num_rounds + 1):
        grad_sum = np.zeros(data.dim)
        for t in tasks:
            grad_sum += local_loss_grad_sums(t.X_train, t.y_train, w)[1]
        g = global_gradient(w, grad_sum, n, lam)
        models, sizes = [], []
        for k, t in enumerate(tasks):
            if (r, k) in skip:
                continue
            if method == "fsvrg":
                s = stats.node_scaling(t.n_train, counts[k][1])
                models.append(fsvrg_local_pass(t.X_train, t.y_train, w, g, lam=lam, h=h, s=s,
                                               order=coordinate_order(seed, k, r, t.n_train)))
            elif method == "dane":
                models.append(dane_local_solve(
                    t.X_train, t.y_train, w, g, lam=lam, step=step, mu=mu,
                    orders=dane_epoch_orders(seed, k, r, t.n_train, epochs)))
            else:
                models.append(naive_fsvrg_local_pass(
                    t.X_train, t.y_train, w, g, lam=lam, h=h,
                    order=uniform_sample_order(seed, k, r, t.n_train)))
            sizes.append(t.n_train)
        if method == "fsvrg":
            w = fsvrg_aggregate(w, models, sizes, stats.a, n=n)
        elif method == "dane":
            w = dane_aggregate(models) if models else w
        else:
            w = naive_fsvrg_aggregate(w, models)
        ws.append(w)
    return ws


def cocoa_reference(data: SparseFederatedDataset, num_rounds: int, *, lam: float,
                    seed: int = 0, skip: frozenset[tuple[int, int]] = frozenset()
                    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """CoCoA+ by direct core calls (``run_cocoa_plus``'s loop); ``skip`` = {(round, task)}
    that take no part. Returns every round's ``w`` and the final alphas."""
    tasks = [data.task(t) for t in range(data.num_tasks)]
    n = int(data.n_train.sum())
    alphas = [np.zeros(t.n_train) for t in tasks]
    w = np.zeros(data.dim)
    ws = [w]
    for r in range(1, num_rounds + 1):
        d_w_sum = np.zeros_like(w)
        for k, t in enumerate(tasks):
            if (r, k) in skip:
                continue
            d_alpha, d_w = cocoa_plus_local_sdca(
                t.X_train, t.y_train, alphas[k], w, lam=lam, n=n, sigma_prime=len(tasks),
                order=coordinate_order(seed, k, r, t.n_train))
            alphas[k] = alphas[k] + d_alpha
            d_w_sum += d_w
        w = cocoa_plus_aggregate(w, d_w_sum)
        ws.append(w)
    return ws, alphas


def per_node_error(data: SparseFederatedDataset, w: np.ndarray) -> float:
    """The mean of the nodes' test error rates (sign(0) = -1), independently of the strategy."""
    rates = [np.mean(np.where(t.X_test @ w > 0.0, 1.0, -1.0) != t.y_test)
             for t in data.tasks if t.y_test.size]
    return float(np.mean(rates))


def committed_alphas(strategy: FSVRG, grid: InProcessGrid) -> list[np.ndarray]:
    """Every node's committed alpha after the run (the final evaluate leaves none pending)."""
    out = []
    for task in range(strategy.num_tasks):
        state = grid.contexts[strategy.task_to_node[task]].state
        meta = state[COCOA_STATE_META]
        assert meta["pending-round"] == -1
        assert meta["committed-round"] == strategy.ledger.last_accepted[task]
        out.append(from_array(state[COCOA_STATE_ARRAYS]["duals"])[0])
    return out


def assert_w_is_w_of_alpha(data: SparseFederatedDataset, strategy: FSVRG,
                           grid: InProcessGrid) -> None:
    """Server ``w`` (and each ledger share) == ``X_k^T alpha_k / (lam n)`` of the nodes."""
    n = int(data.n_train.sum())
    shares = [primal_from_dual(data.task(k).X_train, a, strategy.lam, n)
              for k, a in enumerate(committed_alphas(strategy, grid))]
    for k, share in enumerate(shares):
        np.testing.assert_allclose(strategy.ledger.share(k), share, rtol=0, atol=1e-12)
    np.testing.assert_allclose(strategy.w, sum(shares), rtol=0, atol=1e-12)


def optimum(data: SparseFederatedDataset, lam: float) -> float:
    X, y = data.pooled_train()
    n = X.shape[0]
    fit = LogisticRegression(fit_intercept=False, C=1.0 / (lam * n), tol=1e-12,
                             max_iter=10_000).fit(X, y)
    return logistic_objective(X, y, fit.coef_.ravel(), lam)


# ------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("method,h", [("fsvrg", 8.0), ("fsvrg-naive", 0.05)])
def test_federated_equals_centralised_loop_bit_for_bit(data, method, h):
    lam = 0.01
    strategy = run(data, 3, method=method, lam=lam, h=h, seed=3)
    ws = reference(data, 3, method=method, lam=lam, h=h, seed=3)
    assert np.array_equal(strategy.w, ws[3])
    rounds = strategy.results()["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    X, y = data.pooled_train()
    for k, rec in enumerate(rounds):
        assert rec["objective"] == pytest.approx(logistic_objective(X, y, ws[k], lam),
                                                 rel=1e-12)
        assert rec["num_replies"] in (None, K)
    setup = 1 if method == "fsvrg" else 0
    assert [r["exchanges"] for r in rounds] == [setup + 2 * k for k in range(4)]
    assert strategy.results()["final"]["complete"]


def test_cocoa_plus_equals_the_fig2_loop_bit_for_bit(data):
    lam = 0.01
    strategy, grid = federate(data, 4, method="cocoa-plus", lam=lam, seed=2)
    pooled = Pooled(data)
    ws = [w for _, _, w in run_cocoa_plus(data, pooled, lam, 4, seed=2)]
    assert np.array_equal(strategy.w, ws[4])
    rounds = strategy.results()["rounds"]
    assert [r["exchanges"] for r in rounds] == [0, 1, 2, 3, 4]
    assert [r["num_replies"] for r in rounds] == [None, K, K, K, K]
    assert all(r["num_resets"] in (None, 0) for r in rounds)
    for k, rec in enumerate(rounds):
        assert rec["objective"] == pytest.approx(pooled.objective(ws[k], lam), rel=1e-12)
        assert rec["test_error_pooled"] == pytest.approx(pooled.test_error(ws[k]), abs=1e-15)
        assert rec["test_error"] == pytest.approx(per_node_error(data, ws[k]), abs=1e-12)
    assert strategy.results()["final"]["complete"]
    assert_w_is_w_of_alpha(data, strategy, grid)
    ref_ws, ref_alphas = cocoa_reference(data, 4, lam=lam, seed=2)
    assert np.array_equal(ref_ws[4], ws[4])
    for a, b in zip(committed_alphas(strategy, grid), ref_alphas, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("mu,epochs,step", [(0.0, 1, None), (0.05, 3, 0.02)])
def test_dane_equals_centralised_loop_bit_for_bit(data, mu, epochs, step):
    lam = 0.01
    strategy = run(data, 3, method="dane", lam=lam, mu=mu, local_epochs=epochs, step=step,
                   seed=1)
    ws = reference(data, 3, method="dane", lam=lam, seed=1, step=step, mu=mu, epochs=epochs)
    assert np.array_equal(strategy.w, ws[3])
    rounds = strategy.results()["rounds"]
    assert [r["exchanges"] for r in rounds] == [0, 2, 4, 6]
    X, y = data.pooled_train()
    for k, rec in enumerate(rounds):
        assert rec["objective"] == pytest.approx(logistic_objective(X, y, ws[k], lam),
                                                 rel=1e-12)
    objectives = [r["objective"] for r in rounds]
    assert all(b < a for a, b in zip(objectives, objectives[1:], strict=False))


def test_default_lam_is_one_over_n(data):
    strategy = run(data, 1, method="fsvrg", h=8.0)
    assert strategy.lam == 1.0 / int(data.n_train.sum())
    assert strategy.h == 8.0
    assert FSVRG(3).h == 16.0


# ------------------------------------------------------------------------------ convergence
def test_fsvrg_reaches_the_sklearn_optimum(data):
    lam = 0.01
    fstar = optimum(data, lam)
    strategy = run(data, 15, method="fsvrg", lam=lam, h=8.0, eval_every=5)
    rounds = strategy.results()["rounds"]
    gaps = [(r["objective"] - fstar) / fstar for r in rounds]
    assert min(gaps) > -1e-9  # never below the optimum
    assert gaps[-1] < 1e-3
    assert gaps[-1] < gaps[0] / 100
    X_test, y_test = data.pooled_test()
    err = np.mean(np.where(X_test @ strategy.w > 0, 1.0, -1.0) != y_test)
    assert rounds[-1]["test_error_pooled"] == pytest.approx(err, abs=1e-15)
    assert rounds[-1]["test_error"] == pytest.approx(per_node_error(data, strategy.w), abs=1e-12)
    assert [r["round"] for r in rounds if r["test_error"] is not None] == [0, 5, 10, 15]
    assert all(r["wall_time_s"] >= 0 for r in rounds[1:])


def test_gd_decreases_monotonically(data):
    """GD's default step is 1/L, L = sigma_max(X)^2 / (4n) + lam with sigma_max estimated by
    power-iteration round trips on the pooled Gram operator (counted in ``exchanges``); it was
    1/L_F (a Frobenius bound, several times smaller)."""
    lam = 0.01
    strategy = run(data, 10, method="gd", lam=lam)
    results = strategy.results()
    rounds, final = results["rounds"], results["final"]
    objectives = [r["objective"] for r in rounds]
    assert all(b < a for a, b in zip(objectives, objectives[1:], strict=False))
    p = final["power_iterations"]
    assert 2 <= p <= GD_POWER_MAX_ITER
    assert [r["exchanges"] for r in rounds] == [p + k for k in range(11)]
    X, y = data.pooled_train()
    n = X.shape[0]
    L = float(svds(X, k=1, return_singular_vectors=False)[0]) ** 2 / (4 * n) + lam
    L_F = float(X.multiply(X).sum()) / (4 * n) + lam
    assert final["step"] == strategy.step == 1.0 / final["L_estimate"]
    assert L * (1 - GD_POWER_TOL) <= final["L_estimate"] <= L * (1 + 1e-12)
    assert strategy.step > 2.0 / L_F  # not the Frobenius step
    # the estimate is the centralised power iteration from the same start, to rounding
    v, estimate = gram_power_start(0, data.dim), 0.0
    for _ in range(p):
        estimate, v = power_estimate(v, X.T @ (X @ v))
    assert final["L_estimate"] == pytest.approx(estimate / (4 * n) + lam, rel=1e-12)
    # the last state is gd_step applied 10 times with that step
    w = np.zeros(data.dim)
    for _ in range(10):
        loss, grad = local_loss_grad_sums(X, y, w)
        w = w - strategy.step * global_gradient(w, grad, n, lam)
    np.testing.assert_allclose(strategy.w, w, rtol=1e-10, atol=1e-12)
    assert objectives[-1] == pytest.approx(global_objective(w, local_loss_grad_sums(X, y, w)[0],
                                                            n, lam), rel=1e-10)
    # a given step: no power iteration, recorded as given
    given = run(data, 3, method="gd", lam=lam, step=0.5).results()
    assert given["final"]["step"] == 0.5 and given["final"]["L_estimate"] is None
    assert given["final"]["power_iterations"] == 0
    assert [r["exchanges"] for r in given["rounds"]] == [0, 1, 2, 3]


def test_cocoa_plus_dual_ascends_with_a_nonnegative_gap(data):
    lam = 0.01
    fstar = optimum(data, lam)
    strategy = run(data, 12, method="cocoa-plus", lam=lam)
    rounds = strategy.results()["rounds"]
    primal = np.array([r["objective"] for r in rounds])
    dual = np.array([r["dual"] for r in rounds])
    gap = np.array([r["gap"] for r in rounds])
    np.testing.assert_allclose(gap, primal - dual, rtol=0, atol=1e-15)
    assert np.all(dual <= fstar + 1e-12) and np.all(primal >= fstar - 1e-12)  # weak duality
    assert gap.min() >= 0.0
    assert np.all(np.diff(dual) > 0)  # sigma' = K: every round a safe dual ascent step
    assert gap[-1] < 0.5 * gap[0] and primal[-1] < primal[0]
    assert dual[0] == 0.0 and primal[0] == pytest.approx(np.log(2.0), rel=1e-15)


# ------------------------------------------------------------------------------ faults
BAD_TASK = 4
BAD_ROUND = 2


def corrupt_train(kind: str) -> Callable[[ClientCallable], ClientCallable]:
    def wrap(app: ClientCallable) -> ClientCallable:
        def client(msg: Message, context: Context) -> Message:
            reply = app(msg, context)
            if (context.node_id == FIRST_NODE_ID + BAD_TASK
                    and msg.metadata.message_type == MessageType.TRAIN
                    and int(msg.content["config"]["server-round"]) == BAD_ROUND):
                w_k = np.array(from_array(reply.content["arrays"]["w-local"]))
                if kind == "nan":
                    w_k[7] = np.nan
                elif kind == "wrong-shape":
                    w_k = np.zeros(w_k.shape[0] + 1)
                elif kind == "float32":
                    w_k = w_k.astype(np.float32)
                return Message(RecordDict({"metrics": reply.content["metrics"],
                                           "arrays": ArrayRecord({"w-local": to_array(w_k)})}),
                               reply_to=msg)
            return reply
        return client
    return wrap


@pytest.mark.parametrize("kind", ["nan", "wrong-shape", "float32"])
def test_corrupted_local_model_is_rejected(data, kind, caplog):
    lam, h = 0.01, 8.0
    with caplog.at_level(logging.WARNING):
        strategy = run(data, 3, wrap=corrupt_train(kind), method="fsvrg", lam=lam, h=h)
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(f"round {BAD_ROUND} (train): reply of task {BAD_TASK}" in m and "rejected" in m
               for m in messages), messages
    ws = reference(data, 3, method="fsvrg", lam=lam, h=h,
                   skip=frozenset({(BAD_ROUND, BAD_TASK)}))
    assert np.array_equal(strategy.w, ws[3])
    assert np.all(np.isfinite(strategy.w))
    rounds = strategy.results()["rounds"]
    assert rounds[BAD_ROUND]["num_replies"] == K - 1
    assert rounds[1]["num_replies"] == K


def corrupt(kind: str, key: str) -> Callable[[ClientCallable], ClientCallable]:
    """Break task ``BAD_TASK``'s train reply of round ``BAD_ROUND`` in one way."""
    def wrap(app: ClientCallable) -> ClientCallable:
        def client(msg: Message, context: Context) -> Message:
            hit = (context.node_id == FIRST_NODE_ID + BAD_TASK
                   and msg.metadata.message_type == MessageType.TRAIN
                   and int(msg.content["config"]["server-round"]) == BAD_ROUND)
            if hit and kind == "raise-before":  # Ray: the node's state changes are discarded
                raise RuntimeError("injected crash")
            reply = app(msg, context)
            if not hit:
                return reply
            if kind == "raise-after":  # in-process: the node's state changes are kept
                raise RuntimeError("injected crash")
            metrics = dict(reply.content["metrics"])
            vector = np.array(from_array(reply.content["arrays"][key]))
            if kind == "nan":
                vector[7] = np.nan
            elif kind == "wrong-shape":
                vector = np.zeros(vector.shape[0] + 1)
            elif kind == "float32":
                vector = vector.astype(np.float32)
            elif kind == "wrong-round":
                metrics["round"] = BAD_ROUND - 1
            elif kind == "bad-state-ok":
                metrics["state-ok"] = 2
            elif kind == "bad-dual":
                metrics["dual-sum"] = -1.0
            return Message(RecordDict({"metrics": MetricRecord(metrics),
                                       "arrays": ArrayRecord({key: to_array(vector)})}),
                           reply_to=msg)
        return client
    return wrap


@pytest.mark.parametrize("kind", ["nan", "wrong-shape", "float32", "wrong-round",
                                  "bad-state-ok", "bad-dual", "raise-after", "raise-before"])
def test_cocoa_plus_rejected_reply_rolls_the_node_back(data, kind, caplog):
    lam = 0.01
    with caplog.at_level(logging.WARNING):
        strategy, grid = federate(data, 4, wrap=corrupt(kind, "d-w"), method="cocoa-plus",
                                  lam=lam)
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    reason = "failed" if kind.startswith("raise") else f"reply of task {BAD_TASK}"
    assert any(f"round {BAD_ROUND} (train)" in m and reason in m for m in messages), messages
    ws, alphas = cocoa_reference(data, 4, lam=lam, skip=frozenset({(BAD_ROUND, BAD_TASK)}))
    assert np.array_equal(strategy.w, ws[4])  # as if the node sat that round out
    for a, b in zip(committed_alphas(strategy, grid), alphas, strict=True):
        assert np.array_equal(a, b)
    assert_w_is_w_of_alpha(data, strategy, grid)
    rounds = strategy.results()["rounds"]
    assert rounds[BAD_ROUND]["num_replies"] == K - 1
    assert rounds[BAD_ROUND - 1]["objective"] is None  # its reply completed that record
    assert rounds[BAD_ROUND - 1]["tasks_missing"] == [BAD_TASK]
    assert all(r["num_resets"] in (None, 0) for r in rounds)
    assert rounds[-1]["gap"] >= 0.0


def test_cocoa_plus_node_that_loses_its_state_is_reset(data, caplog):
    """Before round 3 the node of BAD_TASK restarts with an empty state: it replies
    state-ok = 0 from alpha = 0 and the server removes its share of w."""
    lam = 0.01

    def wrap(app: ClientCallable) -> ClientCallable:
        def client(msg: Message, context: Context) -> Message:
            if (context.node_id == FIRST_NODE_ID + BAD_TASK
                    and msg.metadata.message_type == MessageType.TRAIN
                    and int(msg.content["config"]["server-round"]) == 3):
                for key in list(context.state.keys()):
                    del context.state[key]
            return app(msg, context)
        return client

    with caplog.at_level(logging.WARNING):
        strategy, grid = federate(data, 5, wrap=wrap, method="cocoa-plus", lam=lam)
    rounds = strategy.results()["rounds"]
    assert [r["num_resets"] for r in rounds] == [None, 0, 0, 1, 0, 0]
    assert rounds[2]["objective"] is not None  # the loss at w_2 is sound ...
    assert rounds[2]["dual"] is None and rounds[2]["gap"] is None  # ... the pair is not
    assert all(r["gap"] >= 0.0 for r in rounds if r["gap"] is not None)
    assert strategy.ledger.last_accepted.tolist() == [5] * K
    assert_w_is_w_of_alpha(data, strategy, grid)
    assert any("restarted from alpha = 0" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kind", ["nan", "wrong-round", "raise-after"])
def test_dane_rejected_local_model_counts_as_dropped(data, kind, caplog):
    lam = 0.01
    with caplog.at_level(logging.WARNING):
        strategy = run(data, 3, wrap=corrupt(kind, "w-local"), method="dane", lam=lam)
    assert any(f"round {BAD_ROUND} (train)" in r.getMessage() for r in caplog.records
               if r.levelno >= logging.WARNING)
    ws = reference(data, 3, method="dane", lam=lam, skip=frozenset({(BAD_ROUND, BAD_TASK)}))
    assert np.array_equal(strategy.w, ws[3])
    assert strategy.results()["rounds"][BAD_ROUND]["num_replies"] == K - 1


def test_parameter_validation():
    with pytest.raises(ValueError):
        FSVRG(3, method="sgd")
    with pytest.raises(ValueError, match="mu"):
        FSVRG(3, method="dane", mu=-0.1)
    with pytest.raises(ValueError, match="local_epochs"):
        FSVRG(3, method="cocoa-plus", local_epochs=0)
    with pytest.raises(ValueError):
        FSVRG(3, method="fsvrg-naive")  # needs h
    with pytest.raises(ValueError):
        FSVRG(3, lam=-1.0)
    with pytest.raises(ValueError):
        FSVRG(0)
