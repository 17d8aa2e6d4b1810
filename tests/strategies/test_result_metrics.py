"""``start()`` returns a Flower ``Result`` with per-round metrics for every strategy: train
metrics every round, evaluate metrics with the objective or test errors; OFMTL per event
(it returned an empty ``Result``)."""

from __future__ import annotations

import logging

import pytest

from fmtl_flower import (
    FSVRG,
    MOCHA,
    OFMTL,
    FedEM,
    MbSGD,
    make_fedem_client_app,
    make_fsvrg_client_app,
    make_mbsgd_client_app,
    make_mocha_client_app,
    make_ofmtl_client_app,
)
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.data import make_sparse_federated
from fmtl_flower.engine import InProcessGrid

from .helpers import make_problem

ROUNDS = 3


@pytest.fixture(autouse=True)
def quiet() -> None:
    logging.getLogger("flwr").setLevel(logging.WARNING)


@pytest.mark.parametrize("name", ["mocha", "cocoa", "mbsgd", "fedem", "fsvrg", "cocoa-plus"])
def test_result_carries_per_round_metrics(name):
    if name.startswith(("fsvrg", "cocoa-plus")):
        data = make_sparse_federated(num_tasks=4, dim=500, seed=0)
        app = make_fsvrg_client_app(lambda ctx: data.task(default_task_id(ctx)).arrays())
        strategy = FSVRG(4, method=name, discovery_timeout=5.0)
    else:
        problem = make_problem(num_tasks=4)
        factory, cls, kwargs = {
            "mocha": (make_mocha_client_app, MOCHA, {}),
            "cocoa": (make_mocha_client_app, MOCHA, {"method": "cocoa"}),
            "mbsgd": (make_mbsgd_client_app, MbSGD, {}),
            "fedem": (make_fedem_client_app, FedEM, {}),
        }[name]
        app = factory(problem.load)
        strategy = cls(4, discovery_timeout=5.0, **kwargs)
    result = strategy.start(grid=InProcessGrid(app, 4), num_rounds=ROUNDS, timeout=30.0)
    assert sorted(result.train_metrics_clientapp) == list(range(1, ROUNDS + 1))
    assert result.evaluate_metrics_clientapp, "no evaluate metrics"
    last = result.evaluate_metrics_clientapp[max(result.evaluate_metrics_clientapp)]
    assert {"test_error", "primal", "objective", "accuracy_mean"} & set(last), dict(last)


def test_ofmtl_result_carries_every_event():
    problem = make_problem(num_tasks=4, dim=5, samples_per_task=40, seed=2)
    strategy = OFMTL(4, initial_tasks=2, lam=0.05, mocha_rounds=10, inner=5,
                     discovery_timeout=5.0, arrival_timeout=2.0)
    result = strategy.start(grid=InProcessGrid(make_ofmtl_client_app(problem.load), 4),
                            timeout=30.0)
    events = [r["round"] for r in strategy.records]
    assert len(events) >= 3  # the initial training and two newcomers
    assert sorted(result.train_metrics_clientapp) == events
    assert sorted(result.evaluate_metrics_clientapp) == events
    assert result.train_metrics_clientapp[events[-1]]["devices"] == 4
    assert 0.0 <= result.evaluate_metrics_clientapp[events[-1]]["test_error"] <= 1.0
    assert result.arrays["W"].numpy().shape == (5, 4)
