"""MOCHA's (and Mb-SGD's) replies are checked against the state their round was sent with
(:mod:`fmtl_flower.strategies.round_state`), whatever the strategy configured since."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, MessageType

from fmtl_flower.clients.mbsgd import make_mbsgd_client_app
from fmtl_flower.clients.mocha import make_mocha_client_app
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.mbsgd import MbSGD
from fmtl_flower.strategies.mocha import MOCHA
from fmtl_flower.wire import to_array

from .helpers import make_problem

NUM_TASKS = 8


@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=NUM_TASKS, dim=5, samples_per_task=40, seed=3)


def _ready(strategy: MOCHA | MbSGD, num_rounds: int) -> None:
    """What ``start`` sets before round 1 (the run's length and identity)."""
    strategy.num_rounds, strategy.round_timeout = num_rounds, 60.0
    strategy.run_token = "round-state-test"
    strategy.sent_identity = strategy.run_identity()


def _exchange(strategy: MOCHA | MbSGD, grid: InProcessGrid, server_round: int) -> list:
    """Configure a train round, run its devices and return their replies (not read)."""
    messages = list(strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid))
    return list(grid.send_and_receive(messages, timeout=60.0))


def _task_of(reply) -> int:
    return int(reply.content["metrics"]["task-id"])


def test_replies_read_after_a_later_round_was_configured_use_their_own_round(problem):
    """Round 2's replies, read after round 3 was configured (other budgets and drop-outs),
    are checked against round 2's sent state: an honest reply of a task that worked in
    round 2 but is dropped in round 3 passes; a forged nonzero delta-b from a task dropped
    in round 2 (but not in round 3) is rejected by round 2's zero bound."""
    strategy = MOCHA(NUM_TASKS, lam=1e-3, drop_prob=0.4, seed=5, discovery_timeout=5.0)
    grid = InProcessGrid(make_mocha_client_app(problem.load), NUM_TASKS)
    _ready(strategy, 3)
    strategy.aggregate_train(1, _exchange(strategy, grid, 1))
    replies = _exchange(strategy, grid, 2)
    list(strategy.configure_train(3, ArrayRecord(), ConfigRecord(), grid))  # a later round
    sent, later = (strategy.sent_rounds.get(MessageType.TRAIN, r) for r in (2, 3))
    assert sent is not None and later is not None and sent.server_round == 2
    everyone = np.arange(NUM_TASKS)
    worked_then = set(np.flatnonzero((sent.work(everyone) > 0) & (later.work(everyone) == 0)))
    idle_then = set(np.flatnonzero((sent.work(everyone) == 0) & (later.work(everyone) > 0)))
    assert worked_then and idle_then  # the seed gives both kinds of task
    forged = min(idle_then)
    for reply in replies:
        if _task_of(reply) == forged:  # within round 3's bound, above round 2's (0)
            reply.content["arrays"] = ArrayRecord({"delta-b": to_array(np.full(5, 1e-4))})
    accepted = strategy._read_replies(sent, replies)
    assert worked_then <= set(accepted)
    assert forged not in accepted
    assert "above its bound 0" in strategy.replies.last.failed[forged]
    assert set(accepted) == set(range(NUM_TASKS)) - {forged}


def test_mbsgd_replies_read_after_a_later_round_was_configured_use_their_own_round(problem):
    """Mb-SGD alike: round 2's replies, read after round 3 was configured, keep round 2's
    mini-batch budgets: a task dropped in round 3 that worked in round 2 passes with its
    honest count."""
    strategy = MbSGD(NUM_TASKS, lam=1e-3, drop_prob=0.4, seed=5, discovery_timeout=5.0)
    grid = InProcessGrid(make_mbsgd_client_app(problem.load), NUM_TASKS)
    _ready(strategy, 3)
    strategy.aggregate_train(1, _exchange(strategy, grid, 1))
    replies = _exchange(strategy, grid, 2)
    list(strategy.configure_train(3, ArrayRecord(), ConfigRecord(), grid))  # a later round
    sent, later = (strategy.sent_rounds.get(MessageType.TRAIN, r) for r in (2, 3))
    everyone = np.arange(NUM_TASKS)
    worked_then = set(np.flatnonzero((sent.work(everyone) > 0) & (later.work(everyone) == 0)))
    assert worked_then
    counts = {_task_of(r): int(r.content["metrics"]["count"]) for r in replies}
    assert all(counts[t] > 0 for t in worked_then)  # round 3's budget (0) would refuse them
    accepted, _ = strategy._read_replies(sent, replies)
    assert set(accepted) == set(range(NUM_TASKS))


class EvaluateFirst(MOCHA):
    """MOCHA whose last round's train replies are read after the final evaluate exchange
    was configured (a later exchange, made before the train replies are read)."""

    def configure_train(self, server_round, arrays, config, grid):  # noqa: ANN001, ANN201
        self._grid = grid
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):  # noqa: ANN001, ANN201
        if server_round == self.num_rounds:
            replies = list(replies)  # the devices have answered
            list(self.configure_evaluate(server_round, ArrayRecord(), ConfigRecord(),
                                         self._grid))
        return super().aggregate_train(server_round, replies)


def test_train_replies_read_after_the_evaluate_exchange_was_configured_count(problem, caplog):
    """The final evaluate exchange, configured before the last train round's replies are
    read, does not make them foreign: they are read against their own round."""
    strategy = EvaluateFirst(NUM_TASKS, lam=1e-3, discovery_timeout=5.0)
    grid = InProcessGrid(make_mocha_client_app(problem.load), NUM_TASKS)
    with caplog.at_level(logging.WARNING):
        strategy.start(grid=grid, num_rounds=2, timeout=60.0)
    rounds = strategy.results()["rounds"]
    assert [r["num_replies"] for r in rounds[1:]] == [NUM_TASKS, NUM_TASKS]
    assert rounds[-1]["counted"] is True
    assert "answers no message" not in caplog.text


def test_a_round_read_twice_is_a_logged_drop(problem, caplog):
    """Replies to a round whose replies were read already match no sent state: each is
    logged and dropped, and B is not changed twice."""
    strategy = MOCHA(NUM_TASKS, lam=1e-3, discovery_timeout=5.0)
    grid = InProcessGrid(make_mocha_client_app(problem.load), NUM_TASKS)
    _ready(strategy, 3)
    replies = _exchange(strategy, grid, 1)
    strategy.aggregate_train(1, replies)
    B = strategy.state.B.copy()
    with caplog.at_level(logging.WARNING):
        _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["num-replies"] == 0
    np.testing.assert_array_equal(strategy.state.B, B)
    assert "no train messages of this round are awaiting replies" in caplog.text
    assert caplog.text.count("answers no message of this exchange") == NUM_TASKS


def test_the_sent_state_is_frozen(problem):
    """The values a round's replies are checked against cannot change after it was sent."""
    strategy = MOCHA(NUM_TASKS, lam=1e-3, discovery_timeout=5.0)
    grid = InProcessGrid(make_mocha_client_app(problem.load), NUM_TASKS)
    _ready(strategy, 2)
    _exchange(strategy, grid, 1)
    sent = strategy.sent_rounds.get(MessageType.TRAIN, 1)
    for array in (sent.models, sent.w_norm, sent.w_dot_b, sent.budgets, sent.dropped):
        with pytest.raises(ValueError):
            array[0] = 1
    with pytest.raises(AttributeError):
        sent.scale = 2.0  # type: ignore[misc]
