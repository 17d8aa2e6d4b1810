"""Discovery fails fast and clearly: ``start(timeout=...)`` bounds it, too few tasks raise one
exported error naming the missing task ids, ``min_tasks`` runs with whoever shows up, and a
failing node is logged once, not at every poll."""

from __future__ import annotations

import logging
import time

import pytest
from flwr.app import Context, Message

from fmtl_flower import MOCHA, DiscoveryError, FedEM
from fmtl_flower.clients.mocha import make_mocha_client_app
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.discovery import describe_tasks

from .helpers import make_problem


def test_five_nodes_for_eight_tasks_fail_within_the_timeout_naming_the_missing_ones():
    problem = make_problem(num_tasks=8)
    grid = InProcessGrid(make_mocha_client_app(problem.load), 5)  # tasks 0..4 only
    strategy = MOCHA(num_tasks=8, lam=0.1)  # default discovery_timeout: 120 s
    started = time.monotonic()
    with pytest.raises(DiscoveryError, match=r"missing task ids: 5, 6, 7") as caught:
        strategy.start(grid=grid, num_rounds=3, timeout=3.0)
    elapsed = time.monotonic() - started
    assert 3.0 <= elapsed < 3.0 + 3.0, elapsed
    assert isinstance(caught.value, RuntimeError)
    assert caught.value.missing == [5, 6, 7] and caught.value.found == 5
    assert "5 of 8 tasks" in str(caught.value)


def test_min_tasks_runs_with_whoever_shows_up_and_says_who_was_absent():
    problem = make_problem(num_tasks=8)
    grid = InProcessGrid(make_mocha_client_app(problem.load), 5)
    strategy = MOCHA(num_tasks=8, lam=0.1)
    strategy.min_tasks = 5
    strategy.start(grid=grid, num_rounds=2, timeout=2.0)
    final = strategy.results()["final"]
    assert final["tasks_never_replied"] == [5, 6, 7] and final["complete"] is False
    with pytest.raises(ValueError, match="min_tasks"):
        strategy.min_tasks = 9


def test_a_failing_node_is_logged_once_and_named_in_the_error(caplog):
    problem = make_problem(num_tasks=4)
    app = make_mocha_client_app(problem.load)

    def client(message: Message, context: Context) -> Message:
        if context.node_config["partition-id"] == 3:
            raise KeyError("task-id")  # e.g. a loader reading a node config key that is not set
        return app(message, context)

    grid = InProcessGrid(client, 4)
    strategy = FedEM(4, discovery_timeout=60.0)
    with caplog.at_level(logging.WARNING, logger="flwr"), \
            pytest.raises(DiscoveryError, match=r"missing task ids: 3; 1 node\(s\) failed whoami "
                          r"or were excluded, 1 distinct reason\(s\): \[node 1004\] "
                          r"KeyError: 'task-id'$"):
        strategy.start(grid=grid, num_rounds=1, timeout=2.5)
    failures = [r for r in caplog.records if "whoami failed" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in failures]


def test_describe_tasks_lists_few_and_summarises_many():
    assert describe_tasks([7, 5, 6]) == "5, 6, 7"
    many = describe_tasks(range(100, 150))
    assert many.startswith("50 tasks: 100, 101,") and "119, ..." in many
    assert many.endswith("(ids 100..149)") and "120" not in many.split("...")[0]


def test_a_run_where_every_reply_fails_stops_with_the_devices_reason():
    """FedEM(model="softmax") on 3-class labels with num_classes=2: every device fails
    every round; the run stops after max_failed_rounds rounds naming the devices' error
    (it used to run all its rounds and return metrics that were all None)."""
    import numpy as np

    from fmtl_flower import NoValidReplies, make_fedem_client_app

    rng = np.random.default_rng(0)
    data = []
    for _ in range(4):
        X = rng.normal(size=(40, 3))
        data.append((X, np.argmax(X, axis=1)))
    app = make_fedem_client_app(lambda ctx: data[int(ctx.node_config["partition-id"])])
    strategy = FedEM(4, model="softmax", num_classes=2, discovery_timeout=5.0)
    with pytest.raises(NoValidReplies, match=r"3 rounds in a row; 4 of 4 tasks failed with: "
                                             r".*labels outside.*To fix: .*leave the strategy's "
                                             r"num_classes unset") as caught:
        strategy.start(grid=InProcessGrid(app, 4), num_rounds=40, timeout=10.0)
    assert isinstance(caught.value, RuntimeError)
    assert len(strategy.results()["rounds"]) <= 3


def test_fmtl_run_exits_non_zero_with_the_reason(monkeypatch, capsys):
    from fmtl_flower import cli

    def failing_run(args):
        raise DiscoveryError("MOCHA", [5, 6, 7], 5, 8, 20.0, {})

    monkeypatch.setattr(cli, "cmd_run", failing_run)
    assert cli.main(["run", "mocha"]) == 1
    assert "missing task ids: 5, 6, 7" in capsys.readouterr().err


def test_train_and_evaluate_config_reach_the_device_in_every_message():
    from flwr.app import ConfigRecord

    problem = make_problem(num_tasks=4)
    app = make_mocha_client_app(problem.load)
    seen: list[tuple[str, object]] = []

    def client(message: Message, context: Context) -> Message:
        if "whoami" not in message.metadata.message_type:
            seen.append((message.metadata.message_type,
                         message.content["config"].get("user-key")))
        return app(message, context)

    strategy = MOCHA(num_tasks=4, lam=0.1, discovery_timeout=5.0)
    strategy.start(grid=InProcessGrid(client, 4), num_rounds=3, timeout=10.0,
                   train_config=ConfigRecord({"user-key": "train"}),
                   evaluate_config=ConfigRecord({"user-key": "eval"}))
    assert [v for t, v in seen if t == "train"] == ["train"] * 12
    assert [v for t, v in seen if t == "evaluate"] and \
        all(v == "eval" for t, v in seen if t == "evaluate")
    assert strategy.results()["final"]["complete"]
    clash = MOCHA(num_tasks=4, lam=0.1, discovery_timeout=5.0)
    with pytest.raises(ValueError, match="'server-round'"):
        clash.start(grid=InProcessGrid(app, 4), num_rounds=1, timeout=10.0,
                    train_config=ConfigRecord({"server-round": 99}))
