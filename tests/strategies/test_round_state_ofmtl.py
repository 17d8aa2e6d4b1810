"""OFMTL's own exchanges keep their sent state (issue 30): each newcomer step and each
evaluation is made from one frozen :class:`OFMTLSentExchange`, and its replies are checked
against it; a duplicated or late reply is a logged drop that changes nothing."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import Message, MetricRecord, RecordDict

from fmtl_flower.clients.ofmtl import make_ofmtl_client_app
from fmtl_flower.engine import FIRST_NODE_ID
from fmtl_flower.strategies.ofmtl import EVALUATE, NEWCOMER, OFMTL
from fmtl_flower.strategies.round_state import OFMTLSentExchange
from fmtl_flower.wire import from_array

from .helpers import make_problem
from .hostile import HostileGrid, Tamper, untouched

NUM_TASKS = 4
NEWCOMER_TASK = 3  # initial_tasks=3: task 3 joins as the newcomer
OUTER = 3


@pytest.fixture(scope="module")
def problem():
    return make_problem(num_tasks=NUM_TASKS, dim=4, samples_per_task=24, seed=5)


def run(problem, tamper: Tamper = untouched,
        spy: Callable[[OFMTLSentExchange], None] | None = None) -> OFMTL:
    strategy = OFMTL(NUM_TASKS, initial_tasks=3, lam=0.05, mocha_rounds=3, outer=OUTER,
                     inner=4, discovery_timeout=5.0, arrival_timeout=1.0, max_attempts=1)
    if spy is not None:  # see every newcomer reply's check, with the state it is read against
        read = strategy._read_newcomer

        def watched(reply: Message, task: int, sent: OFMTLSentExchange) -> Any:
            spy(sent)
            return read(reply, task, sent)

        strategy._read_newcomer = watched  # type: ignore[method-assign]
    grid = HostileGrid(make_ofmtl_client_app(problem.load), NUM_TASKS)
    grid.tamper = tamper
    strategy.start(grid=grid, timeout=60.0)
    return strategy


@pytest.fixture(scope="module")
def reference(problem) -> OFMTL:
    return run(problem)


def _with_metrics(message: Message, reply: Message, **changes: Any) -> Message:
    """``reply`` answering ``message``, with some metrics changed."""
    content = dict(reply.content.items())
    content["metrics"] = MetricRecord({**dict(reply.content["metrics"]), **changes})
    return Message(RecordDict(content), reply_to=message)


def _is_newcomer(message: Message) -> bool:
    return (message.metadata.message_type == NEWCOMER
            and message.metadata.dst_node_id == FIRST_NODE_ID + NEWCOMER_TASK)


# ------------------------------------------------------------------------------ the record
def test_the_sent_exchange_is_a_frozen_copy_of_what_was_sent():
    c = np.array([1.0, -2.0, 0.5])
    config = {"task-id": 3, "step": 1, "omega": 0.25, "lambda": 0.05}
    sent = OFMTLSentExchange.newcomer(NEWCOMER, config, 3, 7, c)
    c[0] = 99.0
    config["step"] = 2
    np.testing.assert_array_equal(sent.c, [1.0, -2.0, 0.5])
    assert not sent.c.flags.writeable
    assert (sent.step, sent.omega, sent.d, sent.task, dict(sent.chosen)) == (1, 0.25, 3, 3, {3: 7})
    assert sent.config["step"] == 1 and sent.where == "newcomer 3 step 1"
    with pytest.raises(AttributeError):
        sent.step = 2  # type: ignore[misc]
    evaluation = OFMTLSentExchange.evaluation(EVALUATE, 4, {0: 5, 1: 6}, d=3)
    assert (evaluation.server_round, dict(evaluation.config), evaluation.c) == (
        4, {"server-round": 4}, None)
    assert evaluation.where == "evaluation 4"


# ------------------------------------------------------------------------------ checked against
def test_a_newcomer_reply_is_checked_against_the_step_it_was_sent(problem, reference):
    """Every reply check reads the (step, omega, c, node) of the message it answers."""
    sent_messages: list[Message] = []
    checked: list[OFMTLSentExchange] = []

    def keep(message: Message, reply: Message | None) -> list[Message]:
        if _is_newcomer(message):
            sent_messages.append(message)
        return untouched(message, reply)

    strategy = run(problem, keep, spy=checked.append)
    assert len(sent_messages) == len(checked) == OUTER
    for message, sent in zip(sent_messages, checked, strict=True):
        config = message.content["config"]
        assert sent.step == config["step"] and sent.omega == config["omega"]
        np.testing.assert_array_equal(sent.c, from_array(message.content["arrays"]["c"]))
        assert dict(sent.chosen) == {NEWCOMER_TASK: message.metadata.dst_node_id}
        assert sent.exchange.match(message.metadata.message_id) is not None
    assert [s.step for s in checked] == list(range(OUTER))
    np.testing.assert_array_equal(strategy.W, reference.W)


def test_a_newcomer_reply_echoing_another_step_fails_the_attempt(problem, reference, caplog):
    def wrong_step(message: Message, reply: Message | None) -> list[Message]:
        if reply is not None and _is_newcomer(message) and message.content["config"]["step"] == 1:
            return [_with_metrics(message, reply, step=0)]
        return untouched(message, reply)

    with caplog.at_level(logging.WARNING):
        strategy = run(problem, wrong_step)
    assert "newcomer 3 step 1: reply of task 3" in caplog.text and "expected task 3 step 1" \
        in caplog.text
    assert strategy.m == NUM_TASKS - 1  # max_attempts=1: the newcomer was not admitted
    # the attempt left W as it was; the newcomer's protocol never moves the other columns
    np.testing.assert_array_equal(strategy.W, reference.W[:, :NUM_TASKS - 1])
    assert not strategy.results()["final"]["complete"]


def test_an_evaluation_reply_must_echo_the_round_it_was_sent(problem, reference, caplog):
    """A device's test errors for another evaluation are rejected (the old code took them)."""
    def stale_round(message: Message, reply: Message | None) -> list[Message]:
        if (reply is not None and message.metadata.message_type == EVALUATE
                and message.metadata.dst_node_id == FIRST_NODE_ID):
            round_sent = message.content["config"]["server-round"]
            return [_with_metrics(message, reply, round=round_sent + 1)]
        return untouched(message, reply)

    with caplog.at_level(logging.WARNING):
        strategy = run(problem, stale_round)
    assert "expected task 0 round 0" in caplog.text
    records = strategy.results()["rounds"]
    assert records and all(record["tasks_missing"] == [0] for record in records)
    assert all(ref["tasks_missing"] == [] for ref in reference.results()["rounds"])
    np.testing.assert_array_equal(strategy.W, reference.W)  # metrics only: W untouched


# ------------------------------------------------------------------------------ logged drops
def test_a_duplicated_newcomer_reply_is_a_logged_drop(problem, reference, caplog):
    def twice(message: Message, reply: Message | None) -> list[Message]:
        if reply is not None and _is_newcomer(message):
            return [reply, reply]
        return untouched(message, reply)

    with caplog.at_level(logging.WARNING):
        strategy = run(problem, twice)
    assert caplog.text.count("second reply for task 3") == OUTER
    assert strategy.results()["final"]["complete"]
    np.testing.assert_array_equal(strategy.W, reference.W)
    np.testing.assert_array_equal(np.asarray(strategy.Sigma), np.asarray(reference.Sigma))


def test_a_late_reply_to_an_earlier_step_is_a_logged_drop(problem, reference, caplog):
    """Step k's reply delivered again during step k + 1 answers no awaited message: it is
    logged and ignored, and the step is read from its own reply."""
    earlier: list[Message] = []

    def late(message: Message, reply: Message | None) -> list[Message]:
        if reply is None or not _is_newcomer(message):
            return untouched(message, reply)
        out = earlier[-1:] + [reply]
        earlier.append(reply)
        return out

    with caplog.at_level(logging.WARNING):
        strategy = run(problem, late)
    assert caplog.text.count("answers no message of this exchange") == OUTER - 1
    assert "newcomer 3 step 1: reply from node" in caplog.text
    assert strategy.results()["final"]["complete"]
    np.testing.assert_array_equal(strategy.W, reference.W)
    np.testing.assert_array_equal(np.asarray(strategy.Sigma), np.asarray(reference.Sigma))


def test_a_late_evaluation_reply_is_a_logged_drop(problem, reference, caplog):
    earlier: list[Message] = []

    def late(message: Message, reply: Message | None) -> list[Message]:
        if reply is None or message.metadata.message_type != EVALUATE \
                or message.metadata.dst_node_id != FIRST_NODE_ID:
            return untouched(message, reply)
        out = earlier[-1:] + [reply]
        earlier.append(reply)
        return out

    with caplog.at_level(logging.WARNING):
        strategy = run(problem, late)
    assert "evaluation 1: reply from node" in caplog.text
    assert [r["test_error"] for r in strategy.results()["rounds"]] == [
        r["test_error"] for r in reference.results()["rounds"]]
