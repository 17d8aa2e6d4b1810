"""OFMTL as a Flower strategy, in-process: newcomers served alone with O(1) communication,
retraining on the ratio rule, and a newcomer that drops out leaving W and Sigma unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.clients.ofmtl import make_ofmtl_client_app
from fmtl_flower.engine import run_inprocess
from fmtl_flower.strategies.ofmtl import OFMTL

from .helpers import make_problem

ClientCallable = Callable[[Message, Context], Message]
DIM = 5


@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=7, dim=DIM, samples_per_task=40, seed=2)


def run(problem, wrap: Callable[[ClientCallable], ClientCallable] | None = None,
        **kwargs: Any) -> tuple[OFMTL, list[dict]]:
    app = make_ofmtl_client_app(problem.load)
    client = wrap(app) if wrap is not None else app
    events: list[dict] = []
    kwargs.setdefault("initial_tasks", 2)
    kwargs.setdefault("mocha_rounds", 30)
    kwargs.setdefault("inner", 20)
    strategy = OFMTL(problem.num_tasks, lam=0.05, discovery_timeout=5.0, arrival_timeout=2.0,
                     on_record=events.append, **kwargs)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, timeout=60.0)

    run_inprocess(server, client, problem.num_tasks)
    return strategy, events


def test_newcomers_join_with_constant_communication_and_retraining_rule(problem):
    strategy, events = run(problem)
    kinds = [(e["event"], e["devices"]) for e in events]
    # 2 initial; newcomers 3, 4, 5 (3 since the training of 2 >= 1.5 x 2: retrain at 5), 6, 7
    assert kinds == [("initial", 2), ("newcomer", 3), ("newcomer", 4), ("newcomer", 5),
                     ("retrain", 5), ("newcomer", 6), ("newcomer", 7)]
    assert strategy.retrainings == 1 and strategy.results()["final"]["complete"]
    floats = [e["floats_communicated"] for e in events if e["event"] == "newcomer"]
    assert floats == [strategy.outer * (2 * DIM + 1)] * 5  # O(1): independent of m
    for e in events:
        assert e["test_error"] is not None and 0.0 <= e["test_error"] <= 1.0
        assert e["tasks_missing"] == []
    assert strategy.W.shape == (DIM, problem.num_tasks)
    assert np.trace(strategy.Sigma) == pytest.approx(1.0)
    assert all(e["newcomer_gap"] >= -1e-12 for e in events if e["event"] == "newcomer")


def test_only_the_newcomer_trains_while_it_joins(problem):
    log: list[tuple[str, int]] = []

    def wrap(app: ClientCallable) -> ClientCallable:
        def call(msg: Message, context: Context) -> Message:
            log.append((msg.metadata.message_type, default_task_id(context)))
            return app(msg, context)
        return call

    strategy, _ = run(problem, wrap=wrap, retrain_ratio=float("inf"))
    newcomer_msgs = [t for kind, t in log if kind == "train.ofmtl"]
    assert sorted(set(newcomer_msgs)) == [2, 3, 4, 5, 6]
    assert all(newcomer_msgs.count(t) == strategy.outer for t in set(newcomer_msgs))
    # after the initial MOCHA training nobody receives a MOCHA train message again
    first_newcomer = next(i for i, (kind, _) in enumerate(log) if kind == "train.ofmtl")
    assert not [k for k, _ in log[first_newcomer:] if k == "train"]
    # frozen columns: the initial tasks' models never change after MOCHA
    assert strategy.retrainings == 0


def test_newcomer_dropping_out_leaves_w_and_sigma_unchanged(problem):
    snapshots: list[tuple[np.ndarray, np.ndarray]] = []
    holder: dict[str, OFMTL] = {}

    def wrap(app: ClientCallable) -> ClientCallable:
        def call(msg: Message, context: Context) -> Message:
            if msg.metadata.message_type == "train.ofmtl" and default_task_id(context) == 3:
                if int(msg.content["config"]["step"]) == 4:
                    s = holder["strategy"]
                    snapshots.append((s.W.copy(), s.Sigma.copy()))
                    raise RuntimeError("battery died")
            return app(msg, context)
        return call

    app = make_ofmtl_client_app(problem.load)
    strategy = OFMTL(problem.num_tasks, initial_tasks=2, lam=0.05, mocha_rounds=30, inner=20,
                     max_attempts=2, discovery_timeout=5.0, arrival_timeout=2.0)
    holder["strategy"] = strategy
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, timeout=60.0)

    run_inprocess(server, wrap(app), problem.num_tasks)
    assert len(snapshots) == 2  # two attempts, both failed at step 4
    (W1, S1), (W2, S2) = snapshots
    np.testing.assert_array_equal(W1, W2)  # the failed attempt changed nothing
    np.testing.assert_array_equal(S1, S2)
    np.testing.assert_array_equal(strategy.W, W1)
    assert strategy.m == 3 and not strategy.results()["final"]["complete"]


def test_constructor_validation():
    for kwargs, match in (({"initial_tasks": 5}, "below num_tasks"),
                          ({"initial_tasks": 0}, "initial_tasks"), ({"lam": 0.0}, "lam"),
                          ({"initial_tasks": 1, "outer": 0}, "outer"),
                          ({"initial_tasks": 1, "retrain_ratio": 0.0}, "retrain_ratio")):
        with pytest.raises(ValueError, match=match):
            OFMTL(5, **{"initial_tasks": 1, **kwargs})


def test_federated_newcomer_equals_the_centralised_driver(problem):
    from fmtl_flower.core.ofmtl import add_task

    states: list[tuple[np.ndarray, np.ndarray]] = []
    holder: dict[str, OFMTL] = {}

    def snapshot(record: dict) -> None:
        s = holder["strategy"]
        states.append((s.W.copy(), s.Sigma.copy()))

    app = make_ofmtl_client_app(problem.load)
    strategy = OFMTL(problem.num_tasks, initial_tasks=2, lam=0.05, mocha_rounds=30, inner=20,
                     seed=4, retrain_ratio=float("inf"), discovery_timeout=5.0,
                     arrival_timeout=2.0, on_record=snapshot)
    holder["strategy"] = strategy
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, timeout=60.0)

    run_inprocess(server, app, problem.num_tasks)
    for m in range(2, problem.num_tasks):  # event m - 1 admitted task m from state m - 2
        W_prev, S_prev = states[m - 2]
        ref = add_task(W_prev, S_prev, problem.Xs[m], problem.ys[m], lam=0.05,
                       outer=strategy.outer, inner=strategy.inner,
                       local_frac=strategy.newcomer_frac, seed=4, task_id=m)
        np.testing.assert_array_equal(states[m - 1][0], ref.W)
        np.testing.assert_array_equal(states[m - 1][1], ref.Sigma)
