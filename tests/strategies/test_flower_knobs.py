"""Flower's strategy knobs on the task strategies (:mod:`fmtl_flower.strategies.base`):
``min_available_nodes`` waits (and fails within the timeout), ``fraction_train`` /
``min_train_nodes`` sample the right number of devices deterministically per seed, the
metrics aggregation functions are called with the replies and their output lands in the
``Result``; MOCHA's family reports evaluate metrics for every evaluated round."""

from __future__ import annotations

import time

import numpy as np
import pytest
from flwr.app import MetricRecord, RecordDict
from scipy import sparse

from fmtl_flower import (
    FSVRG,
    MOCHA,
    FedEM,
    MbSGD,
    make_fedem_client_app,
    make_fsvrg_client_app,
    make_mocha_client_app,
)
from fmtl_flower.clients.mbsgd import make_mbsgd_client_app
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.discovery import DiscoveryError

from .helpers import make_problem

TASKS = 6


class LateGrid(InProcessGrid):
    """An in-process grid whose last nodes come online ``delay`` seconds after the first
    ``get_node_ids`` call."""

    def __init__(self, *args, late: int, delay: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.late = sorted(self.contexts)[-late:]
        self.delay = delay
        self.first_call: float | None = None

    def get_node_ids(self):
        now = time.monotonic()
        if self.first_call is None:
            self.first_call = now
        hidden = set(self.late) if now - self.first_call < self.delay else set()
        return [n for n in super().get_node_ids() if n not in hidden]


@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=TASKS, dim=4, samples_per_task=24, seed=3)


def mocha(**knobs) -> MOCHA:
    strategy = MOCHA(TASKS, lam=0.1, omega="identity", discovery_timeout=5.0, seed=1)
    for key, value in knobs.items():
        setattr(strategy, key, value)
    return strategy


# ---------------------------------------------------------------- min_available_nodes
def test_min_available_nodes_fails_within_the_timeout(problem):
    strategy = mocha(min_available_nodes=TASKS + 2)
    strategy.discovery_timeout = 1.0
    grid = InProcessGrid(make_mocha_client_app(problem.load), TASKS)
    started = time.monotonic()
    with pytest.raises(DiscoveryError, match=r"6 node\(s\) online .*min_available_nodes = 8"):
        strategy.start(grid=grid, num_rounds=1, timeout=30.0)
    assert time.monotonic() - started < 4.0


def test_min_available_nodes_waits_for_late_nodes(problem):
    grid = LateGrid(make_mocha_client_app(problem.load), TASKS, late=2, delay=0.6)
    strategy = mocha(min_available_nodes=TASKS)
    strategy.discovery_timeout = 5.0
    started = time.monotonic()
    strategy.start(grid=grid, num_rounds=1, timeout=30.0)
    assert time.monotonic() - started >= 0.6
    assert strategy.results()["final"]["complete"]


def test_knob_values_are_checked(problem):
    grid = InProcessGrid(make_mocha_client_app(problem.load), TASKS)
    for key, value in (("min_available_nodes", -1), ("fraction_train", 0.0),
                       ("fraction_train", 1.5), ("min_train_nodes", 1.5),
                       ("train_metrics_aggr_fn", "mean")):
        with pytest.raises(ValueError, match=key):
            mocha(**{key: value}).start(grid=grid, num_rounds=1, timeout=30.0)


def test_a_strategy_that_does_not_sample_refuses_fraction_train(problem):
    fsvrg = FSVRG(TASKS, discovery_timeout=1.0)
    fsvrg.fraction_train = 0.5
    with pytest.raises(ValueError, match="fraction_train"):
        fsvrg.start(grid=InProcessGrid(make_mocha_client_app(problem.load), TASKS),
                    num_rounds=1, timeout=10.0)


# ---------------------------------------------------------------- fraction_train
def sampled_per_round(result) -> list[int]:
    return [int(m["num-sampled"]) for _, m in sorted(result.train_metrics_clientapp.items())]


@pytest.mark.parametrize(("fraction", "minimum", "expected"),
                         [(0.5, 0, 3), (0.34, 0, 2), (0.1, 0, 1), (0.5, 5, 5), (1.0, 0, 6)])
def test_mocha_fraction_train_samples_the_right_count(problem, fraction, minimum, expected):
    strategy = mocha(fraction_train=fraction, min_train_nodes=minimum)
    result = strategy.start(grid=InProcessGrid(make_mocha_client_app(problem.load), TASKS),
                            num_rounds=3, timeout=30.0)
    assert sampled_per_round(result) == [expected] * 3
    for record in strategy.results()["rounds"][1:]:  # the unsampled tasks did no work
        assert record["num_dropped"] == TASKS - expected


def test_mocha_sampling_is_deterministic_per_seed_and_keeps_the_gap(problem):
    def run(seed: int):
        strategy = MOCHA(TASKS, lam=0.1, omega="identity", discovery_timeout=5.0, seed=seed)
        strategy.fraction_train = 0.5
        result = strategy.start(grid=InProcessGrid(make_mocha_client_app(problem.load),
                                                   TASKS), num_rounds=4, timeout=30.0)
        return result.arrays["W"].numpy(), strategy

    W1, s1 = run(1)
    W2, _ = run(1)
    W3, _ = run(2)
    np.testing.assert_array_equal(W1, W2)
    assert not np.array_equal(W1, W3)
    picks = [s1.sample_train_tasks(range(TASKS), r, 1) for r in range(1, 5)]
    assert picks == [s1.sample_train_tasks(range(TASKS), r, 1) for r in range(1, 5)]
    assert len({tuple(p) for p in picks}) > 1  # a new draw every round
    assert all(r["gap"] >= -1e-9 for r in s1.results()["rounds"])  # drops keep W(alpha)


def test_mbsgd_fraction_train(problem):
    strategy = MbSGD(TASKS, lam=0.1, discovery_timeout=5.0)
    strategy.fraction_train = 0.5
    result = strategy.start(grid=InProcessGrid(make_mbsgd_client_app(problem.load), TASKS),
                            num_rounds=2, timeout=30.0)
    assert sampled_per_round(result) == [3, 3]


def test_fedem_fraction_train_and_min_train_nodes(problem):
    def sampled(**knobs) -> list[int]:
        strategy = FedEM(TASKS, method="fedavg", discovery_timeout=5.0, seed=4)
        for key, value in knobs.items():
            setattr(strategy, key, value)
        strategy.start(grid=InProcessGrid(make_fedem_client_app(problem.load), TASKS),
                       num_rounds=2, timeout=30.0)
        return [r["num_sampled"] for r in strategy.results()["rounds"]]

    assert sampled(fraction_train=0.5) == [3, 3]
    assert sampled(fraction_train=0.2, min_train_nodes=4) == [4, 4]
    strategy = FedEM(TASKS, method="fedavg", fraction=0.3, discovery_timeout=5.0)
    strategy.fraction_train = 0.5
    with pytest.raises(ValueError, match="same knob"):
        strategy.start(grid=InProcessGrid(make_fedem_client_app(problem.load), TASKS),
                       num_rounds=1, timeout=30.0)


# ---------------------------------------------------------------- metrics aggregation
class Recorder:
    """A metrics aggregation function that records its calls."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[list[RecordDict], str]] = []

    def __call__(self, contents: list[RecordDict], key: str) -> MetricRecord:
        self.calls.append((contents, key))
        total = sum(c["metrics"][key] for c in contents)
        return MetricRecord({f"{self.name}-calls": len(self.calls), "replies": len(contents),
                             "weight": total})


def test_mocha_metrics_aggregation_functions_land_in_the_result(problem):
    train, evaluate = Recorder("train"), Recorder("evaluate")
    strategy = mocha(train_metrics_aggr_fn=train, evaluate_metrics_aggr_fn=evaluate)
    rounds = 3
    result = strategy.start(grid=InProcessGrid(make_mocha_client_app(problem.load), TASKS),
                            num_rounds=rounds, timeout=30.0)
    assert len(train.calls) == rounds
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    n_total = sum(len(y) for y in problem.ys)
    for r, metrics in result.train_metrics_clientapp.items():
        assert metrics["train-calls"] == r and metrics["replies"] == TASKS
        assert metrics["weight"] == n_total  # weighted_by_key = "n-train"
    contents, key = train.calls[0]
    assert key == "n-train"
    assert {"loss-mean", "dual-mean", "n-train", "task-id"} <= set(contents[0]["metrics"])
    # one evaluation per round's state, 0 .. R (R: the final evaluate message)
    assert sorted(result.evaluate_metrics_clientapp) == list(range(rounds + 1))
    assert len(evaluate.calls) == rounds + 1
    assert all("test-errors" in c["metrics"] for c in evaluate.calls[0][0])
    assert all(m["replies"] == TASKS for m in result.evaluate_metrics_clientapp.values())


def test_fedem_metrics_aggregation_functions_land_in_the_result(problem):
    train, evaluate = Recorder("train"), Recorder("evaluate")
    strategy = FedEM(TASKS, method="fedavg", discovery_timeout=5.0)
    strategy.train_metrics_aggr_fn, strategy.evaluate_metrics_aggr_fn = train, evaluate
    result = strategy.start(grid=InProcessGrid(make_fedem_client_app(problem.load), TASKS),
                            num_rounds=2, timeout=30.0)
    assert [m["train-calls"] for _, m in sorted(result.train_metrics_clientapp.items())] \
        == [1, 2]
    assert evaluate.calls and all(m["evaluate-calls"] >= 1
                                  for m in result.evaluate_metrics_clientapp.values())
    assert "test-correct" in evaluate.calls[-1][0][0]["metrics"]


# ---------------------------------------------------------------- MOCHA's evaluate metrics
@pytest.mark.parametrize("eval_every", [1, 2])
def test_mocha_reports_evaluate_metrics_for_every_evaluated_round(problem, eval_every):
    strategy = MOCHA(TASKS, lam=0.1, discovery_timeout=5.0, eval_every=eval_every)
    rounds = 4
    result = strategy.start(grid=InProcessGrid(make_mocha_client_app(problem.load), TASKS),
                            num_rounds=rounds, timeout=30.0)
    expected = sorted({*range(0, rounds, eval_every), rounds})
    assert sorted(result.evaluate_metrics_clientapp) == expected
    records = strategy.results()["rounds"]
    for k in expected:
        metrics = result.evaluate_metrics_clientapp[k]
        assert metrics["test_error"] == pytest.approx(records[k]["test_error"])
        assert metrics["gap"] == pytest.approx(records[k]["gap"]) and metrics["gap"] >= 0


def test_mbsgd_reports_evaluate_metrics_for_every_round(problem):
    strategy = MbSGD(TASKS, lam=0.1, discovery_timeout=5.0)
    result = strategy.start(grid=InProcessGrid(make_mbsgd_client_app(problem.load), TASKS),
                            num_rounds=3, timeout=30.0)
    assert sorted(result.evaluate_metrics_clientapp) == [0, 1, 2, 3]
    assert all("test_error" in m for m in result.evaluate_metrics_clientapp.values())


# ---------------------------------------------------------------- fraction_evaluate
def fedem_evaluated(problem, **knobs) -> tuple[list[int], FedEM]:
    """Evaluate messages per evaluation round of a 3-round FedAvg run with ``knobs`` given to
    the constructor (Flower's keywords)."""
    app = make_fedem_client_app(problem.load)
    counts: dict[int, int] = {}

    def client(message, context):
        if message.metadata.message_type == "evaluate":
            rnd = int(message.content["config"]["server-round"])
            counts[rnd] = counts.get(rnd, 0) + 1
        return app(message, context)

    strategy = FedEM(TASKS, method="fedavg", discovery_timeout=5.0, seed=4, **knobs)
    strategy.start(grid=InProcessGrid(client, TASKS), num_rounds=3, timeout=30.0)
    return [counts.get(r, 0) for r in (1, 2, 3)], strategy


@pytest.mark.parametrize(("fraction", "minimum", "expected"),
                         [(0.5, 0, 3), (0.2, 0, 1), (0.2, 4, 4), (1.0, 0, 6), (0.0, 0, 0)])
def test_fedem_fraction_evaluate_and_min_evaluate_nodes_as_flower_counts_them(
        problem, fraction, minimum, expected):
    """Flower's FedAvg evaluates max(int(fraction_evaluate * K), min_evaluate_nodes) nodes
    (none at fraction 0); the quickstarts pass fraction_evaluate, which was a TypeError."""
    counts, strategy = fedem_evaluated(problem, fraction_evaluate=fraction,
                                       min_evaluate_nodes=minimum)
    assert counts == [expected] * 3
    final = strategy.results()["final"]
    assert final["tasks_missing"] == []  # the devices left out were not evaluated, not lost
    if expected:
        assert final["accuracy_mean"] is not None


def test_fedem_evaluation_sample_is_deterministic_per_seed(problem):
    first, _ = fedem_evaluated(problem, fraction_evaluate=0.5)
    again, _ = fedem_evaluated(problem, fraction_evaluate=0.5)
    assert first == again


@pytest.mark.parametrize("knobs", [{"fraction_evaluate": 0.5}, {"min_evaluate_nodes": 2}])
def test_strategies_that_evaluate_every_device_refuse_the_evaluate_knobs(problem, knobs):
    grid = InProcessGrid(make_mocha_client_app(problem.load), TASKS)
    strategy = MOCHA(TASKS, lam=0.1, discovery_timeout=5.0, **knobs)  # accepted as keywords
    with pytest.raises(ValueError, match=r"MOCHA evaluates every device.*fraction_evaluate "
                                         r"and min_evaluate_nodes are for the strategies"):
        strategy.start(grid=grid, num_rounds=1, timeout=10.0)


@pytest.mark.parametrize(("key", "value"), [("fraction_evaluate", 1.5),
                                            ("fraction_evaluate", -0.1),
                                            ("min_evaluate_nodes", -1)])
def test_evaluate_knob_values_are_checked(problem, key, value):
    strategy = FedEM(TASKS, method="fedavg", discovery_timeout=5.0)
    setattr(strategy, key, value)
    with pytest.raises(ValueError, match=key):
        strategy.start(grid=InProcessGrid(make_fedem_client_app(problem.load), TASKS),
                       num_rounds=1, timeout=10.0)


def test_evaluate_knobs_are_run_config_keys():
    from fmtl_flower.config import RunConfig, settings_from_config

    cfg = RunConfig.from_mapping({"strategy": "fedavg", "fraction-evaluate": 0.5,
                                  "min-evaluate-nodes": 2})
    settings = settings_from_config(cfg, TASKS)
    assert (settings.fraction_evaluate, settings.min_evaluate_nodes) == (0.5, 2)


# ---------------------------------------------------------------- evaluate_fn, as Flower calls it
class ServerEvaluation:
    """An ``evaluate_fn`` that records the rounds and arrays it was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[str]]] = []

    def __call__(self, server_round: int, arrays) -> MetricRecord:
        self.calls.append((server_round, sorted(arrays)))
        return MetricRecord({"calls": len(self.calls)})


@pytest.mark.parametrize("family", ["mocha", "fsvrg"])
def test_evaluate_fn_is_called_before_round_1_as_flower_does(problem, family):
    """Flower's ``Strategy.start`` calls ``evaluate_fn(0, initial_arrays)`` before round 1,
    then after every round; its results land under rounds 0 .. R."""
    evaluate = ServerEvaluation()
    if family == "mocha":
        strategy, app = mocha(), make_mocha_client_app(problem.load)
        initial = {"W": np.zeros((4, TASKS))}
    else:
        strategy = FSVRG(TASKS, method="gd", discovery_timeout=5.0)
        def load(context):
            X, y, Xt, yt = problem.load(context)
            return sparse.csr_matrix(X), y, sparse.csr_matrix(Xt), yt
        app, initial = make_fsvrg_client_app(load), {"w": np.zeros(4)}
    result = strategy.start(grid=InProcessGrid(app, TASKS), initial_arrays=initial,
                            num_rounds=2, timeout=30.0, evaluate_fn=evaluate)
    assert [r for r, _ in evaluate.calls] == [0, 1, 2]
    assert evaluate.calls[0][1] == sorted(initial)  # the starting arrays
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]
    assert result.evaluate_metrics_serverapp[0]["calls"] == 1


def test_a_resumed_run_does_not_evaluate_round_0_again(problem, tmp_path):
    first, evaluate = mocha(), ServerEvaluation()
    first.enable_checkpoints(tmp_path, every=1)
    first.start(grid=InProcessGrid(make_mocha_client_app(problem.load), TASKS), num_rounds=2,
                timeout=30.0)
    resumed = mocha()
    resumed.enable_checkpoints(tmp_path, every=1)
    result = resumed.start(grid=InProcessGrid(make_mocha_client_app(problem.load), TASKS),
                           num_rounds=3, timeout=30.0, evaluate_fn=evaluate)
    assert resumed.resumed_from == 2
    assert [r for r, _ in evaluate.calls] == [3]
    assert sorted(result.evaluate_metrics_serverapp) == [3]
