"""The per-round log line shows the round's numbers (issue 27, item 5): MOCHA's family its
test error and gap, FedEM's family its accuracy and train loss, not only reply counts."""

from __future__ import annotations

import logging
import re

import pytest

from fmtl_flower import MOCHA, FedEM, make_fedem_client_app, make_mocha_client_app
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.base import round_summary

from .helpers import make_problem

TASKS = 4


def summary_lines(caplog, name: str) -> dict[int, str]:
    pattern = re.compile(rf"└──> {name} round (\d+): (.*)$")
    out = {}
    for record in caplog.records:
        match = pattern.search(record.getMessage())
        if match:
            assert int(match[1]) not in out, "one line per round"
            out[int(match[1])] = match[2]
    return out


def test_mocha_logs_each_rounds_test_error_and_gap(caplog):
    problem = make_problem(num_tasks=TASKS)
    strategy = MOCHA(TASKS, lam=0.1, discovery_timeout=5.0)
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.start(grid=InProcessGrid(make_mocha_client_app(problem.load), TASKS),
                       num_rounds=3, timeout=10.0)
    lines = summary_lines(caplog, "MOCHA")
    assert sorted(lines) == [0, 1, 2, 3]
    for record in strategy.results()["rounds"][1:]:
        line = lines[record["round"]]
        assert line.startswith(f"test error {record['test_error']:.4f}, ")
        assert f"gap {record['gap']:.3e} (relative {record['gap'] / record['primal']:.2e})" \
            in line
        assert line.endswith(f"{TASKS} replies")


def test_fedem_family_logs_accuracy_and_train_loss_under_the_methods_name(caplog):
    problem = make_problem(num_tasks=TASKS)
    strategy = FedEM(TASKS, method="fedavg", discovery_timeout=5.0)
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.start(grid=InProcessGrid(make_fedem_client_app(problem.load), TASKS),
                       num_rounds=2, timeout=10.0)
    lines = summary_lines(caplog, "FedAvg")
    assert sorted(lines) == [1, 2]
    for record in strategy.results()["rounds"]:
        assert f"accuracy {record['accuracy_mean']:.4f}" in lines[record["round"]]
        assert f"train loss {record['train_loss']:.5f}" in lines[record["round"]]


@pytest.mark.parametrize(("metrics", "line"), [
    ({"test_error": 0.25, "gap": 0.5, "primal": 2.0, "num_replies": 3.0},
     "test error 0.2500, gap 5.000e-01 (relative 2.50e-01), 3 replies"),
    ({"objective": 1.5, "test_error": 0.1}, "test error 0.1000, objective 1.500000e+00"),
    ({"test_error": None, "num_replies": 0}, "0 replies"),
])
def test_round_summary_words(metrics, line):
    assert round_summary(metrics) == line
