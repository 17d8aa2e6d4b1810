"""Errors that carry their fix (issue 27, item 4): a device's error the server knows the fix of
says it, in the log and in :class:`DiscoveryError`; the same error of many devices is one
reason, logged in full once; too few nodes for the tasks say what to change; FedEM learns
``num_classes`` from the devices instead of failing after three rounds; MOCHA's ClientApp
takes labels 0/1 with ``labels="auto"``."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from fmtl_flower import MOCHA, DiscoveryError, FedEM, make_fedem_client_app
from fmtl_flower.clients.mocha import make_mocha_client_app
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.discovery import suggested_fix

from .helpers import make_problem

TASKS = 6


def zero_one_loader(problem):
    """The problem's data with labels 0/1 (as a Flower user's loader gives them)."""
    def load(context):
        X, y, Xt, yt = problem.load(context)
        return X, (y > 0).astype(np.int64), Xt, (yt > 0).astype(np.int64)
    return load


def test_labels_zero_one_for_mocha_are_one_reason_logged_once_with_the_fix(caplog):
    problem = make_problem(num_tasks=TASKS)
    grid = InProcessGrid(make_mocha_client_app(zero_one_loader(problem)), TASKS)
    strategy = MOCHA(TASKS, lam=0.1, discovery_timeout=30.0)
    strategy.directory.fail_fast_after = 0.5
    with caplog.at_level(logging.WARNING, logger="flwr"), \
            pytest.raises(DiscoveryError) as caught:
        strategy.start(grid=grid, num_rounds=2, timeout=30.0)
    error = caught.value
    # one reason for the six devices, although each names its own task and label count
    assert len(error.distinct_reasons) == 1
    (reason, nodes), = error.distinct_reasons.items()
    assert "labels must be in {-1, 1}" in reason and len(nodes) == TASKS
    assert f"{TASKS} node(s) failed whoami or were excluded, 1 distinct reason(s)" in str(error)
    assert 'make_mocha_client_app(load, labels="auto")' in str(error)
    assert "y = 2 * y - 1" in str(error) and error.fixes == [suggested_fix(reason)]
    failed = [r.getMessage() for r in caplog.records if "whoami failed" in r.getMessage()]
    assert len(failed) == 1 and 'labels="auto"' in failed[0]
    repeats = [r.getMessage() for r in caplog.records if "more node(s) failed" in r.getMessage()]
    assert len(repeats) == 1 and f"{TASKS - 1} more node(s)" in repeats[0]


def test_labels_auto_takes_zero_one_as_minus_one_plus_one():
    problem = make_problem(num_tasks=TASKS)
    results = []
    for app in (make_mocha_client_app(problem.load),
                make_mocha_client_app(zero_one_loader(problem), labels="auto")):
        strategy = MOCHA(TASKS, lam=0.1, discovery_timeout=10.0)
        strategy.start(grid=InProcessGrid(app, TASKS), num_rounds=3, timeout=10.0)
        results.append(strategy.results()["rounds"])
    keys = ("primal", "dual", "test_error")
    assert [[r[k] for k in keys] for r in results[0]] == \
        [[r[k] for k in keys] for r in results[1]]
    with pytest.raises(ValueError, match="labels must be one of"):
        make_mocha_client_app(problem.load, labels="binary")


def test_labels_pm1_refuses_other_label_sets_naming_them():
    """``labels="pm1"`` (the default) refuses labels other than -1/+1, naming them;
    ``labels="auto"`` takes any two labels as the binary problem (issue 27 item 3 B: the
    smaller -> -1, the larger -> +1; before, it refused them too)."""
    problem = make_problem(num_tasks=2)

    def load(context):
        X, y, Xt, yt = problem.load(context)
        return X, np.where(y > 0, 7, 2), Xt, np.where(yt > 0, 7, 2)

    grid = InProcessGrid(make_mocha_client_app(load), 2)
    strategy = MOCHA(2, lam=0.1, discovery_timeout=10.0)
    strategy.directory.fail_fast_after = 0.5
    with pytest.raises(DiscoveryError, match=r"found \d+ label\(s\) with other values"):
        strategy.start(grid=grid, num_rounds=1, timeout=10.0)
    results = []
    for app in (make_mocha_client_app(problem.load), make_mocha_client_app(load, labels="auto")):
        strategy = MOCHA(2, lam=0.1, discovery_timeout=10.0)
        strategy.start(grid=InProcessGrid(app, 2), num_rounds=3, timeout=10.0)
        results.append([[r[k] for k in ("primal", "dual", "test_error")]
                        for r in strategy.results()["rounds"]])
    assert results[0] == results[1]


def test_fewer_supernodes_than_num_tasks_say_what_to_change():
    problem = make_problem(num_tasks=TASKS)
    grid = InProcessGrid(make_mocha_client_app(problem.load), TASKS - 2)
    with pytest.raises(DiscoveryError) as caught:
        MOCHA(TASKS, lam=0.1).start(grid=grid, num_rounds=1, timeout=1.0)
    assert str(caught.value).endswith(
        "To fix: 4 node(s) hold a task but the run has 6 tasks: set num-tasks (num_tasks=) to "
        "the number of SuperNodes, or set min-tasks (min_tasks=) to run with the tasks found, "
        "or start a SuperNode for each missing task.")


@pytest.mark.parametrize("reason, fix", [
    ("ValueError: Invalid message type: query.whoami", "LegacyGrid(grid)"),
    ("<class 'ValueError'>:<'Invalid message type: query.whoami'>", "LegacyGrid(grid)"),
    ("task-id 9 outside 0..5", "set num-tasks"),
    ("task 2 is claimed by 2 live nodes (1001, 1002): held by none", "task-owners"),
    ("ValueError: task 0 (train): labels must be in {0, 1} (labels='01'); found 3", "class ids"),
    ("KeyError: 'task-id'", None),
])
def test_suggested_fix_knows_the_common_device_errors(reason, fix):
    found = suggested_fix(reason)
    assert (found is None) if fix is None else (fix in found)


def three_class_data(tasks: int = 4):
    rng = np.random.default_rng(0)
    data = []
    for _ in range(tasks):
        X = rng.normal(size=(40, 3))
        data.append((X, np.argmax(X, axis=1)))
    return data


def test_fedem_learns_num_classes_from_the_devices(caplog):
    """Three classes, num_classes not given: it used to fail after 3 rounds with
    NoValidReplies ('labels outside'); now discovery learns 3 from the devices."""
    data = three_class_data()
    app = make_fedem_client_app(lambda ctx: data[int(ctx.node_config["partition-id"])])
    strategy = FedEM(4, model="softmax", discovery_timeout=5.0, seed=1)
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.start(grid=InProcessGrid(app, 4), num_rounds=3, timeout=10.0)
    assert strategy.num_classes == 3
    assert any("num_classes = 3" in r.getMessage() for r in caplog.records)
    rounds = strategy.results()["rounds"]
    assert [r["num_replies"] for r in rounds] == [4, 4, 4]
    assert rounds[-1]["train_loss"] < rounds[0]["train_loss"]
    # the same run with num_classes=3 given: the same numbers
    given = FedEM(4, model="softmax", num_classes=3, discovery_timeout=5.0, seed=1)
    given.start(grid=InProcessGrid(app, 4), num_rounds=3, timeout=10.0)
    assert [r["train_loss"] for r in given.results()["rounds"]] == \
        [r["train_loss"] for r in rounds]


def test_fedem_configured_num_classes_is_kept_and_a_hostile_count_is_refused():
    data = three_class_data()
    app = make_fedem_client_app(lambda ctx: data[int(ctx.node_config["partition-id"])])
    strategy = FedEM(4, model="softmax", num_classes=5, discovery_timeout=5.0)
    strategy.start(grid=InProcessGrid(app, 4), num_rounds=1, timeout=10.0)
    assert strategy.num_classes == 5
    with pytest.raises(Exception, match="num-classes 5000 above the limit 1000"):
        strategy.directory._read_classes(5000)


def test_a_rounds_same_device_error_is_logged_once_with_a_count_and_the_fix(caplog):
    """num_classes=2 on 3-class devices: every device fails every round with the same error
    (its own label list): one line per exchange naming the count, not one per device."""
    from fmtl_flower import NoValidReplies

    data = three_class_data(tasks=6)
    app = make_fedem_client_app(lambda ctx: data[int(ctx.node_config["partition-id"])])
    strategy = FedEM(6, model="softmax", num_classes=2, discovery_timeout=5.0)
    with caplog.at_level(logging.WARNING, logger="flwr"), pytest.raises(NoValidReplies):
        strategy.start(grid=InProcessGrid(app, 6), num_rounds=5, timeout=10.0)
    lines = [r.getMessage() for r in caplog.records if "labels outside" in r.getMessage()]
    exchanges = [line.split(":")[0] for line in lines]  # "FedEM round k" (train, evaluate)
    assert len(lines) == len(exchanges) and 3 <= len(lines) <= 6
    for line in lines:
        assert "the same error from 5 more task(s): 1, 2, 3, 4, 5" in line
        assert "To fix: " in line and "num_classes" in line


def test_a_learned_num_classes_is_resumed_from_the_checkpoint(tmp_path):
    """num_classes unset takes the checkpoint's (learned or given), and goes on as the
    uninterrupted run; a different one given is refused."""
    from fmtl_flower.checkpoint import CheckpointError

    data = three_class_data()
    app = make_fedem_client_app(lambda ctx: data[int(ctx.node_config["partition-id"])])

    def fedem(**kwargs) -> FedEM:
        return FedEM(4, model="softmax", discovery_timeout=5.0, seed=2, **kwargs)

    whole = fedem()
    whole.start(grid=InProcessGrid(app, 4), num_rounds=4, timeout=10.0)
    devices = InProcessGrid(app, 4)  # the devices live on; the server restarts
    first = fedem(num_classes=3)  # given (as a checkpoint written before it was learned)
    first.enable_checkpoints(tmp_path)
    first.start(grid=devices, num_rounds=2, timeout=10.0)
    resumed = fedem()
    resumed.enable_checkpoints(tmp_path)
    resumed.start(grid=devices, num_rounds=4, timeout=10.0)
    assert resumed.resumed_from == 2 and resumed.num_classes == 3
    assert [r["train_loss"] for r in resumed.results()["rounds"]] == \
        [r["train_loss"] for r in whole.results()["rounds"]]
    other = fedem(num_classes=5)
    other.enable_checkpoints(tmp_path)
    with pytest.raises(CheckpointError, match="num_classes"):
        other.start(grid=InProcessGrid(app, 4), num_rounds=4, timeout=10.0)


def claiming_classes(claims: dict[int, int]):
    """A tamper whose whoami replies of the tasks in ``claims`` report those num-classes."""
    from flwr.app import ConfigRecord, Message, RecordDict

    def tamper(message, reply):
        if reply is None:
            return []
        records = dict(reply.content.items())
        infos = [name for name in records if name.split("/")[-1] == "info"]  # packed: slots'
        for name in infos:
            info = dict(records[name])
            if int(info["task-id"]) in claims:
                info["num-classes"] = claims[int(info["task-id"])]
            records[name] = ConfigRecord(info)
        return [Message(RecordDict(records), reply_to=message)] if infos else [reply]
    return tamper


@pytest.mark.parametrize("robust, claims", [(True, {2: 1000}), (True, {1: 1000, 3: 1000})])
def test_a_hostile_minority_does_not_set_num_classes(robust, claims, caplog):
    """One node of 5 claiming 1000 classes (or two) used to make every component 1000 / 3
    times larger; in robust mode the nodes decide (one vote each, within the federation's
    fence): 3, the disagreement logged, the claimants excluded with a reason that says to
    set num_classes."""
    from .hostile import HostileGrid

    data = three_class_data(tasks=5)
    grid = HostileGrid(make_fedem_client_app(lambda c: data[int(c.node_config["partition-id"])]),
                       5)
    grid.tamper = claiming_classes(claims)
    strategy = FedEM(5, model="softmax", discovery_timeout=5.0, seed=1, robust=robust,
                     min_tasks=5 - len(claims))
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.start(grid=grid, num_rounds=2, timeout=10.0)
    assert strategy.num_classes == 3
    assert strategy.components.shape[1] == strategy.model.num_params == 3 * 4
    lines = [r.getMessage() for r in caplog.records]
    assert any("num_classes = 3" in line and "1000: " in line for line in lines)
    excluded = [line for line in lines if "excluded" in line and "num-classes 1000" in line]
    assert len(excluded) == len(claims) and all("set the strategy's num_classes" in x
                                              for x in excluded)
    assert sorted(strategy.directory.task_to_node) == [t for t in range(5) if t not in claims]
    assert [r["num_replies"] for r in strategy.results()["rounds"]] == [5 - len(claims)] * 2


def test_num_classes_is_decided_by_the_nodes():
    """One node: its value; more: the largest report, in robust mode the largest within the
    log-scale fence of the reports (an honest device alone with the top class is kept)."""
    from fmtl_flower.strategies.fedem import decide_num_classes

    assert decide_num_classes([7], robust=True) == 7
    assert decide_num_classes([10, 10, 10, 10, 1000], robust=False) == 1000  # taken at its word
    assert decide_num_classes([10, 10, 10, 10, 1000], robust=True) == 10
    assert decide_num_classes([10, 9, 9, 8], robust=True) == 10
    assert decide_num_classes([3, 3, 3, 3, 4], robust=True) == 4
    assert decide_num_classes([10, 10, 10, 1000, 1000], robust=True) == 10
    assert decide_num_classes([62, 62, 60, 55], robust=True) == 62


def test_a_packed_node_is_one_vote_on_num_classes(caplog):
    """A packed node hosting 4 of the 10 tasks, all claiming 1000 classes, is one vote of 3:
    num_classes 2, its 4 slots excluded."""
    from flwr.app import Context, RecordDict

    from fmtl_flower.apps.common import make_client_app, make_server_app
    from fmtl_flower.config import RunConfig

    from .hostile import HostileGrid

    cfg = RunConfig.from_mapping({
        "dataset": "fedem-synthetic", "num-tasks": 10, "dim": 10, "n-test": 50,
        "num-server-rounds": 1, "fedem.M": 2, "model": "softmax", "seed": 1,
        "strategy": "fedem", "robust": True, "tasks-per-node": 4, "min-tasks": 6})
    grid = HostileGrid(make_client_app(cfg), 3)
    grid.tamper = claiming_classes({0: 1000, 1: 1000, 2: 1000, 3: 1000})
    with caplog.at_level(logging.INFO, logger="flwr"):
        make_server_app(cfg)(grid, Context(run_id=grid.run.run_id, node_id=0, node_config={},
                                           state=RecordDict(), run_config={}))
    lines = [r.getMessage() for r in caplog.records]
    assert any("num_classes = 2, decided by the 3 nodes" in line and "1000: 1 node" in line
               for line in lines), [line for line in lines if "num_classes" in line]
    excluded = [line for line in lines if "excluded" in line and "num-classes 1000" in line]
    assert len(excluded) == 4, excluded
