"""FedEM's family reads each exchange's replies against the state it was sent with
(:class:`~fmtl_flower.strategies.round_state.FedEMSentRound`), whatever the strategy
configured since; a round read twice is a logged drop."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, MessageType

from fmtl_flower.clients.fedem import make_fedem_client_app
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.fedem import FedEM
from fmtl_flower.strategies.privacy import enable_client_dp

from .test_fedem_strategy import mixture_problem

NUM_TASKS = 10


@pytest.fixture(scope="module")
def problem():
    return mixture_problem(num_tasks=NUM_TASKS)


def _setup(problem, **kwargs) -> tuple[FedEM, InProcessGrid]:
    """A FedEM strategy made ready as ``start`` makes it before round 1, and its devices."""
    kwargs = {"lr": 0.5, "batch_size": 32, **kwargs}
    strategy = FedEM(NUM_TASKS, discovery_timeout=5.0, **kwargs)
    strategy.num_rounds, strategy.round_timeout = 5, 60.0
    strategy.run_token = "round-state-fedem-test"
    strategy.sent_identity = strategy.run_identity()
    grid = InProcessGrid(make_fedem_client_app(lambda c: problem[default_task_id(c)]),
                         NUM_TASKS)
    return strategy, grid


def _configure(strategy: FedEM, grid: InProcessGrid, server_round: int,
               message_type: str = MessageType.TRAIN) -> list:
    configure = strategy.configure_train if message_type == MessageType.TRAIN \
        else strategy.configure_evaluate
    return list(configure(server_round, ArrayRecord(), ConfigRecord(), grid))


def _exchange(strategy: FedEM, grid: InProcessGrid, server_round: int,
              message_type: str = MessageType.TRAIN) -> list:
    """Configure an exchange, run its devices and return their replies (not read)."""
    messages = _configure(strategy, grid, server_round, message_type)
    return list(grid.send_and_receive(messages, timeout=60.0))


def _tasks(replies: list) -> set[int]:
    return {int(r.content["metrics"]["task-id"]) for r in replies}


def test_train_replies_read_after_a_later_round_was_configured_use_their_own_sample(problem):
    """Round 2's replies, read after round 3 was configured (another sample of half the
    devices), are read against round 2's exchange: every one is accepted, the record
    counts round 2's sample, and the components move."""
    strategy, grid = _setup(problem, fraction=0.5, aggregation="sampled")
    strategy.aggregate_train(1, _exchange(strategy, grid, 1))
    replies = _exchange(strategy, grid, 2)
    later = _configure(strategy, grid, 3)
    sampled_then = _tasks(replies)
    sampled_later = {int(m.content["config"]["task-id"]) for m in later}
    assert len(sampled_then) == 5 and sampled_then - sampled_later  # two different samples
    before = strategy.components.copy()
    _, metrics = strategy.aggregate_train(2, replies)
    assert metrics["num-replies"] == 5 and metrics["num-dropped"] == 0
    assert strategy.replies.last.failed == {}
    assert set(strategy.replies.last.accepted) == sampled_then
    record = strategy.records[-1]
    assert record["round"] == 2 and record["num_sampled"] == 5 and record["num_dropped"] == 0
    assert not np.array_equal(strategy.components, before)


def test_a_poisson_sample_is_read_with_its_own_round(problem):
    """Client-level DP's secret Poisson sample (``dp.sampling=poisson``): round 2's replies,
    read after round 3 drew its own sample, are read against round 2's: every sampled
    device counts, and the record's ``num_sampled`` is round 2's."""
    pytest.importorskip("dp_accounting")
    strategy, grid = _setup(problem, fraction=0.5)
    enable_client_dp(strategy, mechanism="central", clip=1.0, noise_multiplier=0.0,
                     sampling="poisson", noise_seed=4)
    strategy.aggregate_train(1, _exchange(strategy, grid, 1))
    replies = _exchange(strategy, grid, 2)
    later = {int(m.content["config"]["task-id"]) for m in _configure(strategy, grid, 3)}
    sampled_then = _tasks(replies)
    assert sampled_then and len(sampled_then) != len(later)  # the seed gives two sizes
    _, metrics = strategy.aggregate_train(2, replies)
    assert metrics["num-replies"] == len(sampled_then) and metrics["num-dropped"] == 0
    assert strategy.records[-1]["num_sampled"] == len(sampled_then)


def _bound_just_above_the_honest_steps(strategy: FedEM, replies: list) -> None:
    """``max_update_ratio`` twice the largest honest step (relative to the components sent,
    the server's current ones), asserted small enough that a reference moved by
    :func:`_far` puts every honest reply out of reach."""
    sent = strategy.components.copy()
    steps = [np.linalg.norm(r.content["arrays"]["components"].numpy() - sent)
             / max(np.linalg.norm(sent), 1.0) for r in replies]
    strategy.max_update_ratio = 2 * max(steps)
    assert strategy.max_update_ratio < 0.5


def _far(model: np.ndarray) -> np.ndarray:
    """``model`` moved by 100 times max(|model|, 1) (a reference none of the honest replies
    is within half its norm of)."""
    return model + 100 * max(np.linalg.norm(model), 1.0) / np.sqrt(model.size)


def test_the_update_bound_is_against_the_components_sent(problem):
    """A reply is bounded around the components its round sent, not the server's current
    ones: honest replies pass a bound twice their own step after the server's components
    moved away."""
    strategy, grid = _setup(problem, method="fedavg", lr=0.02)
    replies = _exchange(strategy, grid, 1)
    _bound_just_above_the_honest_steps(strategy, replies)
    strategy.components = _far(strategy.components)  # the server's state moved since
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["num-replies"] == NUM_TASKS
    assert strategy.replies.last.failed == {}


def test_evaluate_replies_read_after_the_next_round_was_configured_count(problem):
    """The evaluate replies of round 1 (Flower's ``fraction_evaluate`` sample), read after
    round 2's train exchange was configured, are read against round 1's evaluate exchange:
    all accepted, and the tasks it left out are not missing."""
    strategy, grid = _setup(problem, fraction_evaluate=0.6)
    strategy.aggregate_train(1, _exchange(strategy, grid, 1))
    replies = _exchange(strategy, grid, 1, MessageType.EVALUATE)
    assert len(replies) == 6
    _configure(strategy, grid, 2)  # the next round's train messages
    metrics = strategy.aggregate_evaluate(1, replies)
    assert metrics is not None
    assert set(strategy.replies.last.accepted) == _tasks(replies)
    record = strategy.records[-1]
    assert record["round"] == 1 and record["tasks_missing"] == []
    assert record["accuracy_mean"] is not None


def test_a_train_round_read_twice_is_a_logged_drop(problem, caplog):
    """Replies to a round whose replies were read already match no sent state: each is
    logged and dropped, and the components are not aggregated twice."""
    strategy, grid = _setup(problem)
    replies = _exchange(strategy, grid, 1)
    strategy.aggregate_train(1, replies)
    components, records = strategy.components.copy(), len(strategy.records)
    with caplog.at_level(logging.WARNING):
        arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is None and metrics["num-replies"] == 0
    np.testing.assert_array_equal(strategy.components, components)
    assert len(strategy.records) == records
    assert "no train messages of this round are awaiting replies" in caplog.text
    assert caplog.text.count("answers no message of this exchange") == NUM_TASKS


def test_an_evaluate_round_read_twice_is_a_logged_drop(problem, caplog):
    """An evaluation read twice is dropped: the round's record is published once."""
    published: list[dict] = []
    strategy, grid = _setup(problem, on_round=published.append)
    strategy.aggregate_train(1, _exchange(strategy, grid, 1))
    replies = _exchange(strategy, grid, 1, MessageType.EVALUATE)
    strategy.aggregate_evaluate(1, replies)
    record = dict(strategy.records[-1])
    with caplog.at_level(logging.WARNING):
        assert strategy.aggregate_evaluate(1, replies) is None
    assert [r["round"] for r in published] == [1]
    assert strategy.records[-1] == record
    assert "no evaluate messages of this round are awaiting replies" in caplog.text
    assert caplog.text.count("answers no message of this exchange") == NUM_TASKS


def test_cfl_replies_are_checked_against_the_cluster_model_they_were_sent(problem):
    """CFL: a training client's reply is bounded around the cluster model it was sent, as
    the exchange recorded it, though its cluster was split off since with another model."""
    strategy, grid = _setup(problem, method="cfl", lr=0.02)
    replies = _exchange(strategy, grid, 1)
    _bound_just_above_the_honest_steps(strategy, replies)
    model = strategy.components[0]
    strategy.clusters = [np.arange(5), np.arange(5, NUM_TASKS)]  # split since it was sent
    strategy.components = np.stack([model, _far(model)])
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["num-replies"] == NUM_TASKS
    assert strategy.replies.last.failed == {}


def test_the_sent_state_is_frozen(problem):
    """The values a round's replies are checked against cannot change after it was sent."""
    strategy, grid = _setup(problem, method="cfl", fraction_evaluate=0.5)
    _exchange(strategy, grid, 1)
    sent = strategy.sent_rounds.get(MessageType.TRAIN, 1)
    assert sent.tasks == tuple(range(NUM_TASKS))
    for array in (sent.components, sent.cluster_of):
        with pytest.raises(ValueError):
            array[0] = 1
    with pytest.raises(TypeError):
        sent.config["lr"] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        sent.tasks = ()  # type: ignore[misc]
