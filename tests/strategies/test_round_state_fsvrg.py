"""The FSVRG family's replies are checked against the exchange they answer
(:class:`~fmtl_flower.strategies.round_state.FSVRGSentExchange`), whatever the strategy
configured since; a round's replies read a second time are dropped."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, MessageType

from fmtl_flower.clients.fsvrg import make_fsvrg_client_app
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.data.sparse_federated import SparseFederatedDataset, make_sparse_federated
from fmtl_flower.engine import InProcessGrid
from fmtl_flower.strategies.fsvrg import FSVRG
from fmtl_flower.strategies.privacy import enable_client_dp
from fmtl_flower.wire import from_array, to_array

K = 8
CLIP = 1e-3  # dp-clip of round 2 (it binds: every device scales its step to it)


@pytest.fixture(scope="module")
def data() -> SparseFederatedDataset:
    return make_sparse_federated(num_tasks=K, dim=500, seed=0)


def _grid(data: SparseFederatedDataset) -> InProcessGrid:
    app = make_fsvrg_client_app(lambda ctx: data.task(default_task_id(ctx)).arrays())
    return InProcessGrid(app, K)


def _ready(strategy: FSVRG, num_rounds: int) -> FSVRG:
    """What ``start`` sets before round 1 (the run's length and identity)."""
    strategy.num_rounds, strategy.round_timeout = num_rounds, 60.0
    strategy.run_token = "round-state-fsvrg-test"
    strategy.sent_identity = strategy.run_identity()
    return strategy


def _exchange(strategy: FSVRG, grid: InProcessGrid, server_round: int) -> list:
    """Configure a train round, run its devices and return their replies (not read)."""
    messages = list(strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid))
    return list(grid.send_and_receive(messages, timeout=60.0))


def _task_of(reply) -> int:
    return int(reply.content["metrics"]["task-id"])


def test_cocoa_plus_replies_read_after_a_later_round_use_their_own_round(data):
    """CoCoA+ under client-level DP (``client-clip``): round 2's replies, read after round 3
    was configured with another ``dp-clip`` (as adaptive clipping moves it), answer round 2's
    messages and are read against round 2's state: every reply is accepted, and a ``d-w``
    ten times round 2's clip (within round 3's, and within every other bound) is clipped to
    round 2's clip before it enters the device's share of w."""
    strategy = _ready(enable_client_dp(
        FSVRG(K, method="cocoa-plus", discovery_timeout=5.0, robust=False),
        mechanism="client-clip", clip=CLIP, noise_multiplier=0.0), 3)
    grid = _grid(data)
    strategy.aggregate_train(1, _exchange(strategy, grid, 1))
    replies = _exchange(strategy, grid, 2)
    strategy.privacy.clip = 100 * CLIP  # the clip round 3 is sent with
    list(strategy.configure_train(3, ArrayRecord(), ConfigRecord(), grid))
    sent, later = (strategy.sent_rounds.get(MessageType.TRAIN, r) for r in (2, 3))
    assert sent is not None and later is not None and sent.server_round == 2
    assert (sent.dp_clip, later.dp_clip) == (CLIP, 100 * CLIP)
    forged = 3
    for reply in replies:
        if _task_of(reply) == forged:
            d_w = from_array(reply.content["arrays"]["d-w"])
            assert np.linalg.norm(d_w) == pytest.approx(CLIP)  # the device scaled it
            reply.content["arrays"] = ArrayRecord({"d-w": to_array(10 * d_w)})
    before = strategy.ledger.share(forged)
    num_replies, _ = strategy._aggregate_cocoa_plus(sent, replies)
    assert num_replies == K
    assert strategy.ledger.last_accepted[forged] == 2
    step = strategy.ledger.share(forged) - before
    assert np.linalg.norm(step) == pytest.approx(CLIP, rel=1e-9)


def test_naive_replies_read_after_a_later_round_moved_w_use_the_w_they_were_sent(data):
    """fsvrg-naive: round 2's local models, read after round 3 was configured and
    aggregated (w moved on), are read against round 2's exchange and its w_t: every honest
    reply is accepted, and a local model twice as far from round 2's w_t as its bound
    allows is rejected."""
    strategy = _ready(FSVRG(K, method="fsvrg-naive", h=0.2, discovery_timeout=5.0,
                            robust=False), 3)
    grid = _grid(data)
    strategy.aggregate_train(1, _exchange(strategy, grid, 1))
    replies = _exchange(strategy, grid, 2)
    sent = strategy.sent_rounds.get(MessageType.TRAIN, 2)
    assert sent is not None
    strategy.aggregate_train(2, [])  # round 2's replies are late
    strategy.aggregate_train(3, _exchange(strategy, grid, 3))
    assert not np.array_equal(strategy.w, sent.w)  # w moved on since round 2
    forged = 5
    for reply in replies:
        if _task_of(reply) == forged:
            w_t = sent.w
            bound = strategy.max_update_ratio * max(float(np.linalg.norm(w_t)), 1.0)
            step = np.ones_like(w_t) / np.sqrt(w_t.size) * 2 * bound
            reply.content["arrays"] = ArrayRecord({"w-local": to_array(w_t + step)})
    accepted = strategy._read_replies(sent, replies)
    assert set(accepted) == set(range(K)) - {forged}
    assert "|w-local - w|" in strategy.replies.last.failed[forged]


@pytest.mark.parametrize("method", ["cocoa-plus", "fsvrg-naive"])
def test_a_round_read_twice_is_a_logged_drop(data, method, caplog):
    """Round 1's replies given to ``aggregate_train`` a second time: logged and dropped; w,
    CoCoA+'s ledger and the records are as after the first read."""
    strategy = _ready(FSVRG(K, method=method, h=0.2, discovery_timeout=5.0), 2)
    grid = _grid(data)
    replies = _exchange(strategy, grid, 1)
    strategy.aggregate_train(1, replies)
    w, records = strategy.w.copy(), [dict(r) for r in strategy.records]
    shares = None if strategy.ledger is None else strategy.ledger.total()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["num-replies"] == 0
    np.testing.assert_array_equal(strategy.w, w)
    assert [dict(r) for r in strategy.records] == records
    if shares is not None:
        np.testing.assert_array_equal(strategy.ledger.total(), shares)
    assert any("no train messages of this round are awaiting replies" in m
               for m in caplog.messages), caplog.messages


def test_the_final_evaluate_read_twice_is_a_logged_drop(data, caplog):
    """The final ``evaluate`` replies read a second time: dropped, the final record kept."""
    strategy = _ready(FSVRG(K, method="gd", step=1.0, discovery_timeout=5.0), 1)
    grid = _grid(data)
    strategy.aggregate_train(1, _exchange(strategy, grid, 1))
    messages = list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), grid))
    replies = list(grid.send_and_receive(messages, timeout=60.0))
    assert strategy.aggregate_evaluate(1, replies) is not None
    final = dict(strategy.records[1])
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert strategy.aggregate_evaluate(1, replies) is None
    assert dict(strategy.records[1]) == final
    assert any("no evaluate messages of this round are awaiting replies" in m
               for m in caplog.messages), caplog.messages
