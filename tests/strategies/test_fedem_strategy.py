"""FedEM and its baselines as a Flower strategy, run in-process: learning, sampling, unseen
clients, and rejection of bad replies with the state intact."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.clients.fedem import STATE_ARRAYS, make_fedem_client_app
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.engine import run_inprocess
from fmtl_flower.strategies.fedem import FedEM
from fmtl_flower.wire import from_array, to_array

ClientCallable = Callable[[Message, Context], Message]


def mixture_problem(num_tasks: int = 12, dim: int = 6, seed: int = 0):
    """Tasks whose labels come from a task-specific mixture of two linear rules."""
    rng = np.random.default_rng(seed)
    thetas = rng.normal(size=(2, dim)) * 4
    pis = rng.dirichlet([0.4, 0.4], size=num_tasks)
    data = []
    for t in range(num_tasks):
        parts = []
        for n in (int(rng.integers(60, 160)), 300):
            X = rng.uniform(-1, 1, size=(n, dim))
            z = rng.random(n) < pis[t, 0]
            y = np.where(z, X @ thetas[0] > 0, X @ thetas[1] > 0).astype(float)
            parts += [X, y]
        data.append(tuple(parts))
    return data


def run(data, rounds: int = 15, wrap: Callable[[ClientCallable], ClientCallable] | None = None,
        **kwargs: Any) -> tuple[FedEM, Any]:
    def load(context: Context):
        return data[default_task_id(context)]

    app = make_fedem_client_app(load)
    client = wrap(app) if wrap is not None else app
    kwargs.setdefault("lr", 0.5)
    kwargs.setdefault("batch_size", 32)
    strategy = FedEM(len(data), discovery_timeout=5.0, **kwargs)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, num_rounds=rounds, timeout=60.0)

    grid = run_inprocess(server, client, len(data))
    return strategy, grid


@pytest.fixture(scope="module")
def problem():
    return mixture_problem()


def test_fedem_learns_the_mixture_and_beats_fedavg(problem):
    fedem, _ = run(problem, num_components=2)
    fedavg, _ = run(problem, method="fedavg")
    a, b = fedem.results()["final"], fedavg.results()["final"]
    assert a["complete"] and b["complete"]
    assert a["accuracy_mean"] > b["accuracy_mean"] + 0.05
    assert a["accuracy_mean"] > 0.8
    losses = [r["train_loss"] for r in fedem.results()["rounds"]]
    assert losses[-1] < losses[0]
    for key in ("accuracy_mean", "accuracy_mean_unweighted", "accuracy_bottom_decile",
                "test_error", "train_loss", "num_replies", "wall_time_s"):
        assert a[key] is not None


def test_same_seed_same_result_and_seed_matters(problem):
    a, _ = run(problem, rounds=4, num_components=2, seed=3)
    b, _ = run(problem, rounds=4, num_components=2, seed=3)
    c, _ = run(problem, rounds=4, num_components=2, seed=4)
    np.testing.assert_array_equal(a.components, b.components)
    assert not np.array_equal(a.components, c.components)


def test_sampling_rate_and_unseen_clients_never_train(problem):
    trained: list[int] = []

    def wrap(app: ClientCallable) -> ClientCallable:
        def call(msg: Message, context: Context) -> Message:
            if msg.metadata.message_type == "train":
                trained.append(int(msg.content["config"]["task-id"]))
            return app(msg, context)
        return call

    strategy, _ = run(problem, rounds=6, wrap=wrap, num_components=2, fraction=0.5,
                      unseen_tasks=[10, 11])
    rounds = strategy.results()["rounds"]
    assert all(r["num_sampled"] == 5 for r in rounds)  # floor(0.5 * 10 training clients)
    assert not {10, 11} & set(trained)
    final = strategy.results()["final"]
    assert final["unseen_accuracy_mean"] is not None
    assert final["unseen_accuracy_bottom_decile"] is not None


def test_unseen_clients_fit_pi_and_stay_close_to_training_clients(problem):
    strategy, _ = run(problem, rounds=15, num_components=2, unseen_tasks=[9, 10, 11])
    final = strategy.results()["final"]
    assert final["unseen_accuracy_mean"] > final["accuracy_mean"] - 0.1


def test_authors_and_unbiased_aggregation_differ_under_sampling(problem):
    a, _ = run(problem, rounds=3, num_components=2, fraction=0.5, aggregation="all")
    b, _ = run(problem, rounds=3, num_components=2, fraction=0.5, aggregation="sampled")
    assert not np.allclose(a.components, b.components)
    # full participation: both rules are the same weighted average
    c, _ = run(problem, rounds=3, num_components=2, aggregation="all")
    d, _ = run(problem, rounds=3, num_components=2, aggregation="sampled")
    np.testing.assert_allclose(c.components, d.components, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "fedavg-ft", "clustered", "local"])
def test_baselines_run_and_report(problem, method):
    kwargs = {"prox_mu": 0.1} if method == "fedprox" else {}
    strategy, _ = run(problem, rounds=5, method=method, num_components=2, **kwargs)
    final = strategy.results()["final"]
    assert final["complete"] and 0.5 < final["accuracy_mean"] <= 1.0
    assert strategy.components.shape[0] == (2 if method == "clustered" else 1)


def test_local_keeps_its_model_on_the_device(problem):
    strategy, grid = run(problem, rounds=3, method="local")
    start = strategy.components.copy()
    own = from_array(grid.contexts[1001].state[STATE_ARRAYS]["own"])
    assert not np.allclose(own, start)  # trained locally, the server's copy never moves
    np.testing.assert_array_equal(strategy.components, start)


BAD_REPLIES = {
    "wrong-shape": lambda c, w: {"components": c[:, :-1], "weights": w},
    "nan": lambda c, w: {"components": np.where(np.arange(c.size).reshape(c.shape) == 3,
                                                np.nan, c), "weights": w},
    "huge": lambda c, w: {"components": c * 0 + 1e9, "weights": w},
    "float32": lambda c, w: {"components": c.astype(np.float32), "weights": w},
    "bad-weights": lambda c, w: {"components": c, "weights": w * 2},
    "one-component-only": lambda c, w: {"components": c, "weights": w * (np.arange(w.size) == 0)},
}


@pytest.mark.parametrize("kind", sorted(BAD_REPLIES))
def test_bad_replies_rejected_with_reason_state_intact(problem, kind, caplog):
    bad_task = 4
    make = BAD_REPLIES[kind]

    def wrap(app: ClientCallable) -> ClientCallable:
        def call(msg: Message, context: Context) -> Message:
            reply = app(msg, context)
            if msg.metadata.message_type == "train" and default_task_id(context) == bad_task:
                arrays = reply.content["arrays"]
                c = np.array(from_array(arrays["components"]))
                w = np.array(from_array(arrays["weights"]))
                record = ArrayRecord({k: to_array(v) for k, v in make(c, w).items()})
                return Message(RecordDict({"arrays": record,
                                           "metrics": reply.content["metrics"]}), reply_to=msg)
            return reply
        return call

    with caplog.at_level(logging.WARNING, logger="flwr"):
        bad, _ = run(problem, rounds=3, wrap=wrap, num_components=2, aggregation="sampled")
    assert "rejected" in caplog.text and f"task {bad_task}" in caplog.text
    assert all(r["num_replies"] == 11 and r["num_dropped"] == 1
               for r in bad.results()["rounds"])
    assert np.all(np.isfinite(bad.components)) and np.abs(bad.components).max() < 1e3

    # the state equals that of a federation in which the bad client did not answer at all
    def silent(app: ClientCallable) -> ClientCallable:
        def call(msg: Message, context: Context) -> Message:
            reply = app(msg, context)
            if msg.metadata.message_type == "train" and default_task_id(context) == bad_task:
                raise RuntimeError("offline")
            return reply
        return call

    ref, _ = run(problem, rounds=3, wrap=silent, num_components=2, aggregation="sampled")
    np.testing.assert_array_equal(bad.components, ref.components)


def test_reply_for_another_task_or_round_rejected(problem, caplog):
    def wrap(app: ClientCallable) -> ClientCallable:
        def call(msg: Message, context: Context) -> Message:
            reply = app(msg, context)
            if msg.metadata.message_type == "train" and default_task_id(context) == 2:
                reply.content["metrics"]["task-id"] = 3
            return reply
        return call

    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy, _ = run(problem, rounds=2, wrap=wrap, num_components=2)
    assert "expected task 2" in caplog.text
    assert all(r["num_replies"] == 11 for r in strategy.results()["rounds"])


def test_constructor_validation():
    for kwargs, match in (({"method": "fedsgd"}, "method"), ({"model": "cnn"}, "model"),
                          ({"fraction": 0.0}, "fraction"), ({"aggregation": "x"}, "aggregation"),
                          ({"method": "fedprox", "prox_mu": 0.0}, "prox_mu"),
                          ({"num_components": 0}, "num_comp"),
                          ({"unseen_tasks": [0, 1, 2]}, "at least one"),
                          ({"unseen_tasks": [7]}, "task ids"), ({"lr": -1.0}, "lr")):
        with pytest.raises(ValueError, match=match):
            FedEM(3, **kwargs)
