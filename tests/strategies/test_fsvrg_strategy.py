"""FSVRG / naive FSVRG / GD strategies with their ClientApp, run in-process.

* parity: the federation equals a Flower-free loop over :mod:`fmtl_flower.core.fsvrg` bit for bit;
* convergence to the scikit-learn optimum; GD decreases the objective monotonically;
* faults: a corrupted local model (NaN, wrong shape) is rejected with a logged reason and the
  model equals the run in which that node's reply never counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp
from sklearn.linear_model import LogisticRegression

from fmtl_flower.clients.fsvrg import make_fsvrg_client_app
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.core.fsvrg import (
    combine_feature_counts,
    fsvrg_aggregate,
    fsvrg_local_pass,
    global_gradient,
    global_objective,
    local_loss_grad_sums,
    logistic_objective,
    naive_fsvrg_aggregate,
    naive_fsvrg_local_pass,
    node_feature_counts,
    uniform_sample_order,
)
from fmtl_flower.core.rng import coordinate_order
from fmtl_flower.data.sparse_federated import SparseFederatedDataset, make_sparse_federated
from fmtl_flower.engine import FIRST_NODE_ID, run_inprocess
from fmtl_flower.strategies.fsvrg import Fsvrg
from fmtl_flower.wire import from_array, to_array

from .helpers import ClientCallable

K = 20
DIM = 500


@pytest.fixture(scope="module")
def data() -> SparseFederatedDataset:
    return make_sparse_federated(num_tasks=K, dim=DIM, seed=0)


def run(data: SparseFederatedDataset, num_rounds: int,
        wrap: Callable[[ClientCallable], ClientCallable] | None = None,
        **kwargs: Any) -> Fsvrg:
    app = make_fsvrg_client_app(lambda ctx: data.task(default_task_id(ctx)).arrays())
    client = wrap(app) if wrap is not None else app
    strategy = Fsvrg(data.num_tasks, discovery_timeout=5.0, **kwargs)
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=num_rounds, timeout=60.0)

    run_inprocess(server_app, client, data.num_tasks)
    return strategy


def reference(data: SparseFederatedDataset, num_rounds: int, *, method: str, lam: float,
              h: float, seed: int = 0, skip: frozenset[tuple[int, int]] = frozenset()
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
            else:
                models.append(naive_fsvrg_local_pass(
                    t.X_train, t.y_train, w, g, lam=lam, h=h,
                    order=uniform_sample_order(seed, k, r, t.n_train)))
            sizes.append(t.n_train)
        if method == "fsvrg":
            w = fsvrg_aggregate(w, models, sizes, stats.a, n=n)
        else:
            w = naive_fsvrg_aggregate(w, models)
        ws.append(w)
    return ws


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


def test_default_lam_is_one_over_n(data):
    strategy = run(data, 1, method="fsvrg", h=8.0)
    assert strategy.lam == 1.0 / int(data.n_train.sum())
    assert strategy.h == 8.0
    assert Fsvrg(3).h == 16.0


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
    assert rounds[-1]["test_error"] == pytest.approx(err, abs=1e-15)
    assert [r["round"] for r in rounds if r["test_error"] is not None] == [0, 5, 10, 15]
    assert all(r["wall_time_s"] >= 0 for r in rounds[1:])


def test_gd_decreases_monotonically(data):
    lam = 0.01
    strategy = run(data, 10, method="gd", lam=lam)
    rounds = strategy.results()["rounds"]
    objectives = [r["objective"] for r in rounds]
    assert all(b < a for a, b in zip(objectives, objectives[1:], strict=False))
    assert [r["exchanges"] for r in rounds] == list(range(11))
    X, y = data.pooled_train()
    L_F = float(X.multiply(X).sum()) / (4 * X.shape[0]) + lam
    assert strategy.step == pytest.approx(1.0 / L_F, rel=1e-12)
    # the last state is gd_step applied 10 times with that step
    w = np.zeros(data.dim)
    for _ in range(10):
        loss, grad = local_loss_grad_sums(X, y, w)
        w = w - strategy.step * global_gradient(w, grad, X.shape[0], lam)
    np.testing.assert_allclose(strategy.w, w, rtol=1e-10, atol=1e-12)
    assert objectives[-1] == pytest.approx(global_objective(w, local_loss_grad_sums(X, y, w)[0],
                                                            X.shape[0], lam), rel=1e-10)


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


def test_parameter_validation():
    with pytest.raises(ValueError):
        Fsvrg(3, method="dane")
    with pytest.raises(ValueError):
        Fsvrg(3, method="fsvrg-naive")  # needs h
    with pytest.raises(ValueError):
        Fsvrg(3, lam=-1.0)
    with pytest.raises(ValueError):
        Fsvrg(0)
