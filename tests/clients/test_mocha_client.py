"""MOCHA's ClientApp handlers, called through the ClientApp with hand-built Messages.

Covers the whoami query, the dual commit protocol (design decision 4, the module docstring of
:mod:`fmtl_flower.clients.mocha`) case by case, and the validation of malformed instructions
(the handler raises, Flower turns that into an error reply, ``context.state`` is untouched).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import ServerApp

from fmtl_flower.clients.dual_state import data_fingerprint
from fmtl_flower.clients.mocha import STATE_ARRAYS, STATE_META, make_mocha_client_app
from fmtl_flower.core.hinge import (
    check_dual_feasible,
    classification_errors,
    hinge_conjugate_value,
    mean_hinge_loss,
)
from fmtl_flower.core.rng import coordinate_order
from fmtl_flower.core.sdca import sdca_local_update
from fmtl_flower.data import make_synthetic_tasks
from fmtl_flower.engine import InProcessGrid, run_inprocess
from fmtl_flower.strategies.mocha import MOCHA
from fmtl_flower.wire import from_array, to_array

TASK = 2
N, D, N_TEST = 20, 4, 8
M_TT, SIGMA_P = 7.0, 1.0
NODE = 5


def _make_data() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(1234)
    w_true = rng.standard_normal(D)
    X = rng.standard_normal((N + N_TEST, D))
    y = np.where(X @ w_true >= 0.0, 1.0, -1.0)
    y[[0, 5, 11]] *= -1.0  # some label noise: the hinge optimum has active duals
    return X[:N], y[:N], X[N:], y[N:]


X, Y, X_TEST, Y_TEST = _make_data()


def load_data(context: Context) -> tuple[np.ndarray, ...]:
    return X, Y, X_TEST, Y_TEST


@pytest.fixture
def app():
    """A fresh ClientApp (its per-node caches must not leak between tests)."""
    return make_mocha_client_app(load_data)


def make_context(node_config: dict[str, Any] | None = None, node_id: int = NODE,
                 run_id: int = 1) -> Context:
    config = {"task-id": TASK} if node_config is None else node_config
    return Context(run_id=run_id, node_id=node_id, node_config=config, state=RecordDict(),
                   run_config={})


def train_msg(server_round: int, last_accepted: int, w: np.ndarray | None = None, *,
              drop: tuple[str, ...] = (), node: int = NODE, **overrides: Any) -> Message:
    """A ``train`` instruction as the strategy builds it (keys in ``drop`` left out)."""
    config: dict[str, Any] = {
        "task-id": TASK, "server-round": server_round, "last-accepted-round": last_accepted,
        "m-tt": M_TT, "sigma-prime": SIGMA_P, "budget": N, "seed": 3, "dropped": False,
        "eval": False,
    }
    config.update(overrides)
    for key in drop:
        del config[key]
    w = np.zeros(D) if w is None else w
    content = RecordDict({"arrays": ArrayRecord({"w": to_array(w)}),
                          "config": ConfigRecord(config)})
    return Message(content, dst_node_id=node, message_type=MessageType.TRAIN,
                   group_id=str(server_round))


def eval_msg(server_round: int, last_accepted: int, w: np.ndarray | None = None,
             **overrides: Any) -> Message:
    """An ``evaluate`` instruction (the final metrics round)."""
    config: dict[str, Any] = {
        "task-id": TASK, "server-round": server_round, "last-accepted-round": last_accepted,
        "m-tt": M_TT, "sigma-prime": SIGMA_P, "seed": 3, "eval": True,
    }
    config.update(overrides)
    w = np.zeros(D) if w is None else w
    content = RecordDict({"arrays": ArrayRecord({"w": to_array(w)}),
                          "config": ConfigRecord(config)})
    return Message(content, dst_node_id=NODE, message_type=MessageType.EVALUATE,
                   group_id=str(server_round))


def whoami_msg(node: int = NODE) -> Message:
    return Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=node,
                   message_type=f"{MessageType.QUERY}.whoami")


def delta_b(reply: Message) -> np.ndarray:
    return from_array(reply.content["arrays"]["delta-b"])


def metrics(reply: Message) -> dict[str, Any]:
    return dict(reply.content["metrics"])


def duals(context: Context) -> np.ndarray:
    """The stored [committed alpha; pending d_alpha] (a copy)."""
    return np.array(from_array(context.state[STATE_ARRAYS]["duals"]))


def meta(context: Context) -> dict[str, Any]:
    """The stored meta without ``data``, which must be the fingerprint of (X, Y)."""
    out = dict(context.state[STATE_META])
    assert out.pop("data") == data_fingerprint(X, Y)
    return out


def snapshot(context: Context) -> dict[str, Any]:
    """Everything the handlers may have written to ``context.state``, by value."""
    out: dict[str, Any] = {"keys": sorted(context.state.keys())}
    if STATE_META in context.state:
        out["meta"] = meta(context)
    if STATE_ARRAYS in context.state:
        out["duals"] = duals(context).tobytes()
    return out


def expected_update(alpha: np.ndarray, w: np.ndarray, server_round: int,
                    seed: int = 3, budget: int = N) -> tuple[np.ndarray, np.ndarray]:
    """What the device must compute: SDCA from ``alpha`` at ``w`` (the core, called directly)."""
    return sdca_local_update(X, Y, alpha, w, budget=budget, m_tt=M_TT, sigma_prime=SIGMA_P,
                             order=coordinate_order(seed, TASK, server_round, N))


def random_w(seed: int) -> np.ndarray:
    return 0.5 * np.random.default_rng(seed).standard_normal(D)


# ------------------------------------------------------------------------------ whoami
def test_whoami_reports_task_id_from_node_config_and_sizes(app):
    context = make_context({"task-id": 3, "partition-id": 0})
    reply = app(whoami_msg(), context)
    assert not reply.has_error()
    info = dict(reply.content["info"])
    row_norm = info.pop("max-row-norm")  # the server bounds delta-b with it (issue 15)
    assert row_norm == float(np.sqrt(np.einsum("ij,ij->i", X, X).max()))
    assert info == {"task-id": 3, "n-train": N, "n-test": N_TEST, "dim": D}
    assert all(type(v) is int for v in info.values())
    assert len(context.state.keys()) == 0  # whoami writes no state


@pytest.mark.parametrize("node_config, expected", [
    ({"partition-id": 4, "num-partitions": 6}, 4),  # simulation
    ({"task-id": "7"}, 7),  # --node-config "task-id=7" may arrive as a string
    ({"task-id": 0, "partition-id": 5}, 0),  # task-id wins, even when 0
])
def test_whoami_task_id_sources(app, node_config, expected):
    reply = app(whoami_msg(), make_context(node_config))
    assert reply.content["info"]["task-id"] == expected


@pytest.mark.parametrize("node_config", [{}, {"num-partitions": 3}, {"task-id": "abc"}])
def test_whoami_without_usable_task_id_is_an_error(app, node_config):
    with pytest.raises(ValueError, match="task-id"):
        app(whoami_msg(), make_context(node_config))


def test_whoami_without_task_id_gives_error_reply_through_grid(app):
    grid = InProcessGrid(app, 1)
    node = next(iter(grid.contexts))
    grid.contexts[node] = Context(run_id=1, node_id=node, node_config={}, state=RecordDict(),
                                  run_config={})
    [reply] = grid.send_and_receive([whoami_msg(node)], timeout=10)
    assert reply.has_error()
    assert "task-id" in reply.error.reason


# ------------------------------------------------------------------------------ dual commit
def test_fresh_state_first_round_is_state_ok(app):
    context = make_context()
    w = random_w(0)
    reply = app(train_msg(1, 0, w), context)
    m = metrics(reply)
    assert m["state-ok"] == 1 and m["round"] == 1 and m["task-id"] == TASK and m["n-train"] == N
    assert m["dual-mean"] == 0.0
    assert m["loss-mean"] == mean_hinge_loss(X, Y, w)
    d_alpha, d_b = expected_update(np.zeros(N), w, 1)
    assert np.array_equal(delta_b(reply), d_b)
    assert delta_b(reply).dtype == np.float64 and delta_b(reply).shape == (D,)
    stored = duals(context)
    assert np.array_equal(stored[0], np.zeros(N))
    assert np.array_equal(stored[1], d_alpha)
    assert meta(context) == {"task-id": TASK, "committed-round": 0,
                             "pending-round": 1, "stable-round": -1}
    assert np.any(d_alpha != 0)


def test_pending_is_committed_when_its_round_was_accepted(app):
    context = make_context()
    app(train_msg(1, 0, random_w(1)), context)
    p1 = duals(context)[1]
    w2 = random_w(2)
    reply = app(train_msg(2, 1, w2), context)
    m = metrics(reply)
    assert m["state-ok"] == 1
    alpha = np.zeros(N) + p1  # old + pending
    assert m["dual-mean"] == hinge_conjugate_value(alpha, Y)
    assert m["dual-mean"] > 0
    stored = duals(context)
    assert np.array_equal(stored[0], alpha)
    assert meta(context) == {"task-id": TASK, "committed-round": 1,
                             "pending-round": 2, "stable-round": -1}
    d_alpha, d_b = expected_update(alpha, w2, 2)  # SDCA started from the committed alpha
    assert np.array_equal(delta_b(reply), d_b)
    assert np.array_equal(stored[1], d_alpha)
    # and once more: alpha accumulates the pendings in order
    app(train_msg(3, 2, random_w(3)), context)
    assert np.array_equal(duals(context)[0], alpha + d_alpha)
    assert meta(context)["committed-round"] == 2


def test_pending_is_rolled_back_when_its_round_was_not_accepted(app):
    context = make_context()
    app(train_msg(1, 0, random_w(1)), context)
    p1 = duals(context)[1]
    app(train_msg(2, 1, random_w(2)), context)  # commits round 1, pending round 2
    # round 2's reply was lost: the server still says 1
    w3 = random_w(3)
    reply = app(train_msg(3, 1, w3), context)
    m = metrics(reply)
    assert m["state-ok"] == 1
    assert m["dual-mean"] == hinge_conjugate_value(p1, Y)
    stored = duals(context)
    assert np.array_equal(stored[0], p1)
    assert meta(context) == {"task-id": TASK, "committed-round": 1,
                             "pending-round": 3, "stable-round": -1}
    d_alpha, d_b = expected_update(p1, w3, 3)
    assert np.array_equal(delta_b(reply), d_b)
    assert np.array_equal(stored[1], d_alpha)


def test_first_round_rolled_back_to_zero(app):
    context = make_context()
    app(train_msg(1, 0, random_w(1)), context)
    reply = app(train_msg(2, 0, random_w(2)), context)  # round 1 was never accepted
    assert metrics(reply)["state-ok"] == 1
    assert metrics(reply)["dual-mean"] == 0.0
    assert np.array_equal(duals(context)[0], np.zeros(N))
    assert meta(context)["committed-round"] == 0


def _three_accepted_rounds(app, context: Context) -> None:
    for r in (1, 2, 3):
        app(train_msg(r, r - 1, random_w(r)), context)


@pytest.mark.parametrize("how", ["clear", "new-context"])
def test_lost_state_restarts_from_zero(app, how):
    context = make_context()
    _three_accepted_rounds(app, context)
    assert np.any(duals(context)[0] != 0)
    if how == "clear":  # the device restarted: context.state is empty again
        for key in list(context.state.keys()):
            del context.state[key]
    else:  # a restarted SuperNode: a new Context (the same node id, empty state)
        context = make_context()
    w4 = random_w(4)
    reply = app(train_msg(4, 3, w4), context)  # the server has accepted round 3
    m = metrics(reply)
    assert m["state-ok"] == 0
    assert m["dual-mean"] == 0.0
    d_alpha, d_b = expected_update(np.zeros(N), w4, 4)
    assert np.array_equal(delta_b(reply), d_b)
    stored = duals(context)
    assert np.array_equal(stored[0], np.zeros(N))
    assert np.array_equal(stored[1], d_alpha)
    assert meta(context) == {"task-id": TASK, "committed-round": 0,
                             "pending-round": 4, "stable-round": -1}
    # the server resets b_t and accepts round 4: the device commits on top of zero
    reply = app(train_msg(5, 4, random_w(5)), context)
    assert metrics(reply)["state-ok"] == 1
    assert np.array_equal(duals(context)[0], np.zeros(N) + d_alpha)


def _restore(context: Context, saved: RecordDict) -> None:
    for key in list(context.state.keys()):
        del context.state[key]
    for key in saved.keys():
        context.state[key] = saved[key]


def _copy_state(context: Context) -> RecordDict:
    """A by-value copy of the device state (new record objects)."""
    out = RecordDict()
    out[STATE_ARRAYS] = ArrayRecord({"duals": to_array(duals(context))})
    out[STATE_META] = ConfigRecord(meta(context))
    return out


def test_state_reverted_to_older_round_is_not_ok(app):
    context = make_context()
    app(train_msg(1, 0, random_w(1)), context)
    app(train_msg(2, 1, random_w(2)), context)
    saved = _copy_state(context)  # committed 1, pending 2
    app(train_msg(3, 2, random_w(3)), context)
    app(train_msg(4, 3, random_w(4)), context)
    _restore(context, saved)  # e.g. Ray discarded the last two calls' state changes
    reply = app(train_msg(5, 4, random_w(5)), context)
    assert metrics(reply)["state-ok"] == 0
    assert metrics(reply)["dual-mean"] == 0.0
    assert np.array_equal(duals(context)[0], np.zeros(N))
    assert meta(context)["committed-round"] == 0


def test_state_of_another_task_is_not_used(app):
    context = make_context()
    _three_accepted_rounds(app, context)
    stored = _copy_state(context)
    stored[STATE_META]["task-id"] = TASK + 1  # the node served another task before
    _restore(context, stored)
    reply = app(train_msg(4, 3, random_w(4)), context)
    assert metrics(reply)["state-ok"] == 0
    assert np.array_equal(duals(context)[0], np.zeros(N))


def test_state_newer_than_the_server_is_reset(app):
    """The server accepted round 1 of this task, the device has committed three rounds."""
    context = make_context()
    _three_accepted_rounds(app, context)
    reply = app(train_msg(4, 1, random_w(9)), context)
    assert metrics(reply)["state-ok"] == 0
    assert np.array_equal(duals(context)[0], np.zeros(N))
    assert meta(context)["committed-round"] == 0


def test_new_run_starts_clean_without_a_reset(app, caplog):
    """A new server run (last-accepted-round 0: it holds nothing of the task) meets a device
    that has committed rounds of another run: alpha = 0 is what the server holds, so the
    device starts clean and says so, and this is no reset (state-ok 1)."""
    context = make_context()
    _three_accepted_rounds(app, context)
    with caplog.at_level(logging.INFO, logger="flwr"):
        reply = app(train_msg(1, 0, random_w(9)), context)
    assert metrics(reply)["state-ok"] == 1
    assert metrics(reply)["dual-mean"] == 0.0
    assert np.array_equal(duals(context)[0], np.zeros(N))
    assert meta(context)["committed-round"] == 0 and meta(context)["pending-round"] == 1
    assert "new run" in caplog.text and "starting clean" in caplog.text


def test_state_of_other_data_is_not_resumed(tmp_path):
    """A device restarted with another dataset of the same size must not load its old duals
    from the state file (task id and n match): the task restarts, the server resets it."""
    first = make_mocha_client_app(load_data)
    context = make_context({"task-id": TASK, "client-state-dir": str(tmp_path)})
    _three_accepted_rounds(first, context)
    X2 = X[::-1].copy()  # same shapes, other data
    second = make_mocha_client_app(lambda ctx: (X2, Y, X_TEST, Y_TEST))
    fresh = make_context({"task-id": TASK, "client-state-dir": str(tmp_path)})
    reply = second(train_msg(4, 3, random_w(4)), fresh)
    assert metrics(reply)["state-ok"] == 0
    assert metrics(reply)["dual-mean"] == 0.0
    # the same data again: the state file is resumed
    again = make_context({"task-id": TASK, "client-state-dir": str(tmp_path)})
    third = make_mocha_client_app(lambda ctx: (X2, Y, X_TEST, Y_TEST))
    assert metrics(third(train_msg(5, 4, random_w(5)), again))["state-ok"] == 1


def test_dual_feasibility_and_consistency_over_many_rounds(app):
    """A single-task 'server' that loses a third of the replies at random.

    After every message: 0 <= y * alpha <= 1 for the committed alpha and for alpha + pending,
    and the server's b equals X^T alpha / n for the alpha the device committed.
    """
    context = make_context()
    rng = np.random.default_rng(7)
    b = np.zeros(D)
    accepted = 0
    for r in range(1, 61):
        w = M_TT * b  # W(alpha) for Sigma = I/m, lambda = 1/(m * M_TT)
        if r % 7 == 0:
            w = w + 0.3 * rng.standard_normal(D)  # a stale or perturbed model
        reply = app(train_msg(r, accepted, w, budget=int(rng.integers(1, 2 * N))), context)
        assert metrics(reply)["state-ok"] == 1
        stored = duals(context)
        alpha = stored[0]
        np.testing.assert_allclose(X.T @ alpha / N, b, rtol=0, atol=1e-12)
        assert check_dual_feasible(alpha, Y, tol=1e-12)
        assert check_dual_feasible(alpha + stored[1], Y, tol=1e-12)
        assert 0.0 <= metrics(reply)["dual-mean"] <= 1.0
        if rng.random() > 1 / 3:  # the server accepts the reply
            b = b + delta_b(reply)
            accepted = r
    assert accepted > 30
    assert np.count_nonzero(Y * duals(context)[0] == 1.0) > 0  # some duals at the bound


def test_same_seed_round_and_task_give_identical_delta_b():
    replies = []
    for node in (11, 12):  # two devices (two apps) holding the same task
        app = make_mocha_client_app(load_data)
        context = make_context(node_id=node)
        replies.append([delta_b(app(train_msg(r, r - 1, random_w(r), budget=N // 2), context))
                        for r in (1, 2, 3)])
    for a, b in zip(*replies, strict=True):
        assert a.tobytes() == b.tobytes()
    # a different seed visits the coordinates in another order
    other = make_mocha_client_app(load_data)(train_msg(1, 0, random_w(1), budget=N // 2, seed=4),
                                             make_context(node_id=13))
    assert not np.array_equal(delta_b(other), replies[0][0])


@pytest.mark.parametrize("how", [{"dropped": True}, {"budget": 0}])
def test_dropped_round_does_no_work_but_commits(app, how):
    context = make_context()
    app(train_msg(1, 0, random_w(1)), context)
    p1 = duals(context)[1]
    w2 = random_w(2)
    reply = app(train_msg(2, 1, w2, **how), context)
    m = metrics(reply)
    assert m["state-ok"] == 1
    assert m["loss-mean"] == mean_hinge_loss(X, Y, w2)
    assert m["dual-mean"] == hinge_conjugate_value(p1, Y)
    assert np.array_equal(delta_b(reply), np.zeros(D))
    assert delta_b(reply).dtype == np.float64 and delta_b(reply).shape == (D,)
    stored = duals(context)
    assert np.array_equal(stored[0], p1)  # the commit, nothing else
    assert np.array_equal(stored[1], np.zeros(N))
    assert meta(context) == {"task-id": TASK, "committed-round": 1,
                             "pending-round": 2, "stable-round": -1}
    app(train_msg(3, 2, random_w(3)), context)
    assert np.array_equal(duals(context)[0], p1)


def test_dropped_first_round(app):
    context = make_context()
    reply = app(train_msg(1, 0, random_w(1), dropped=True), context)
    assert np.array_equal(delta_b(reply), np.zeros(D))
    assert np.array_equal(duals(context), np.zeros((3, N)))


def test_evaluate_commits_and_reports_test_errors(app):
    context = make_context()
    app(train_msg(1, 0, random_w(1)), context)
    p1 = duals(context)[1]
    w = random_w(5)
    reply = app(eval_msg(1, 1, w), context)
    assert "arrays" not in reply.content
    m = metrics(reply)
    assert m["state-ok"] == 1 and m["round"] == 1
    assert m["test-errors"] == classification_errors(X_TEST, Y_TEST, w)
    assert m["test-n"] == N_TEST
    assert m["dual-mean"] == hinge_conjugate_value(p1, Y)
    assert np.array_equal(duals(context)[0], p1)
    assert meta(context) == {"task-id": TASK, "committed-round": 1,
                             "pending-round": -1, "stable-round": -1}


def test_evaluate_rolls_back_an_unaccepted_pending(app):
    context = make_context()
    app(train_msg(1, 0, random_w(1)), context)
    p1 = duals(context)[1]
    app(train_msg(2, 1, random_w(2)), context)
    reply = app(eval_msg(2, 1), context)  # round 2's reply was lost
    assert metrics(reply)["state-ok"] == 1
    assert np.array_equal(duals(context)[0], p1)
    assert meta(context)["committed-round"] == 1


def test_train_reports_test_errors_when_eval(app):
    w = random_w(1)
    m = metrics(app(train_msg(1, 0, w, eval=True), make_context()))
    assert m["test-errors"] == classification_errors(X_TEST, Y_TEST, w)
    assert m["test-n"] == N_TEST
    assert "test-n" not in metrics(app(train_msg(1, 0, w), make_context(node_id=6)))


# ------------------------------------------------------------------------------ malformed
def _bad_w(kind: str) -> np.ndarray:
    return {
        "short": np.zeros(D - 1),
        "long": np.zeros(D + 1),
        "2d": np.zeros((D, 1)),
        "float32": np.zeros(D, dtype=np.float32),
        "int64": np.zeros(D, dtype=np.int64),
        "nan": np.array([0.0, np.nan, 0.0, 0.0]),
        "inf": np.array([0.0, 0.0, -np.inf, 0.0]),
    }[kind]


def _malformed(case: str) -> Message:
    """A round-4 instruction (server accepted round 3) broken in one way."""
    if case.startswith("missing-"):
        return train_msg(4, 3, drop=(case.removeprefix("missing-"),))
    if case.startswith("w-"):
        return train_msg(4, 3, _bad_w(case.removeprefix("w-")))
    msg = train_msg(4, 3)
    if case == "no-w":
        msg.content["arrays"] = ArrayRecord({"v": to_array(np.zeros(D))})
    elif case == "no-arrays-record":
        msg = Message(RecordDict({"config": msg.content["config"]}), dst_node_id=NODE,
                      message_type=MessageType.TRAIN)
    elif case == "no-config-record":
        msg = Message(RecordDict({"arrays": msg.content["arrays"]}), dst_node_id=NODE,
                      message_type=MessageType.TRAIN)
    else:
        overrides = {
            "other-task": {"task-id": TASK + 1},
            "round-float": {"server-round": 4.0},
            "budget-negative": {"budget": -1},
            "budget-bool": {"budget": True},
            "m-tt-zero": {"m-tt": 0.0},
            "m-tt-nan": {"m-tt": float("nan")},
            "sigma-prime-negative": {"sigma-prime": -1.0},
            "sigma-prime-inf": {"sigma-prime": float("inf")},
            "dropped-int": {"dropped": 1},
            "eval-int": {"eval": 1},
            "last-accepted-str": {"last-accepted-round": "3"},
        }[case]
        msg = train_msg(4, 3, **overrides)
    return msg


MALFORMED = [
    *(f"missing-{k}" for k in ("task-id", "server-round", "last-accepted-round", "m-tt",
                               "sigma-prime", "budget", "seed", "dropped")),
    *(f"w-{k}" for k in ("short", "long", "2d", "float32", "int64", "nan", "inf")),
    "no-w", "no-arrays-record", "no-config-record", "other-task", "round-float",
    "budget-negative", "budget-bool", "m-tt-zero", "m-tt-nan", "sigma-prime-negative",
    "sigma-prime-inf", "dropped-int", "eval-int", "last-accepted-str",
]


def _reason(case: str) -> str:
    """A regex the error message must match: it names what is wrong."""
    if case.startswith("missing-"):
        return f"lacks '{case.removeprefix('missing-')}'"
    if case.startswith("w-"):
        return "'w' must be finite float64 of shape"
    return {
        "no-w": "lacks array 'w'", "no-arrays-record": "needs 'config' and 'arrays'",
        "no-config-record": "needs 'config' and 'arrays'",
        "other-task": "for task 3 reached the node of task 2",
        "round-float": "'server-round' must be an int", "budget-negative": "invalid budget",
        "budget-bool": "'budget' must be an int", "m-tt-zero": "invalid budget/m-tt",
        "m-tt-nan": "'m-tt' is not finite", "sigma-prime-negative": "sigma-prime",
        "sigma-prime-inf": "'sigma-prime' is not finite",
        "dropped-int": "'dropped' must be a bool", "eval-int": "'eval' must be a bool",
        "last-accepted-str": "'last-accepted-round' must be an int",
    }[case]


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_train_instruction_raises_and_leaves_state(app, case):
    context = make_context()
    _three_accepted_rounds(app, context)
    before = snapshot(context)
    msg = _malformed(case)
    with pytest.raises(ValueError, match=_reason(case)):
        app(msg, context)
    assert snapshot(context) == before


@pytest.mark.parametrize("overrides", [
    {"task-id": TASK + 1}, {"last-accepted-round": None}, {"server-round": None},
])
def test_malformed_evaluate_instruction_raises_and_leaves_state(app, overrides):
    context = make_context()
    _three_accepted_rounds(app, context)
    before = snapshot(context)
    msg = eval_msg(3, 3, **{k: v for k, v in overrides.items() if v is not None})
    for key in [k for k, v in overrides.items() if v is None]:
        del msg.content["config"][key]
    with pytest.raises(ValueError):
        app(msg, context)
    assert snapshot(context) == before


def test_malformed_instruction_is_an_error_reply_through_grid(app):
    """Through an engine, the handler's exception becomes a Flower error reply."""
    grid = InProcessGrid(app, 1, node_configs=[{"task-id": TASK}])
    node = next(iter(grid.contexts))
    context = grid.contexts[node]
    _three_accepted_rounds(app, context)
    before = snapshot(context)
    msg = train_msg(4, 3, _bad_w("nan"), node=node)
    [reply] = grid.send_and_receive([msg], timeout=10)
    assert reply.has_error()
    assert "'w' must be finite float64" in reply.error.reason
    assert snapshot(context) == before


@pytest.mark.parametrize("last_accepted", [-1, 9])
def test_out_of_range_last_accepted_round_is_rejected(app, last_accepted):
    context = make_context()
    _three_accepted_rounds(app, context)
    before = snapshot(context)
    with pytest.raises(ValueError):
        app(train_msg(4, last_accepted), context)
    assert snapshot(context) == before


# ------------------------------------------------------------------------------ caches
def test_in_place_change_of_stored_duals_is_seen(app):
    context = make_context()
    _three_accepted_rounds(app, context)  # committed 2, pending 3
    stored = duals(context)
    stored[1] = 0.0  # the pending change of round 3 zeroed, in the same record object
    context.state[STATE_ARRAYS]["duals"] = to_array(stored)
    app(train_msg(4, 3, random_w(4)), context)
    assert np.array_equal(duals(context)[0], stored[0] + stored[1])


def test_state_records_are_updated_in_place_or_replaced_when_foreign(app):
    """The lean state write: the records of the previous message are updated in place (the
    values a fresh write would hold); a record with other contents is replaced whole."""
    context = make_context()
    app(train_msg(1, 0, random_w(1)), context)
    arrays, meta_record = context.state[STATE_ARRAYS], context.state[STATE_META]
    app(train_msg(2, 1, random_w(2)), context)
    assert context.state[STATE_ARRAYS] is arrays and context.state[STATE_META] is meta_record
    assert meta(context) == {"task-id": TASK, "committed-round": 1, "pending-round": 2,
                             "stable-round": -1}
    kept = duals(context)
    arrays["junk"] = to_array(np.zeros(2))  # foreign contents: rewritten, not patched
    meta_record["extra"] = 1
    app(train_msg(3, 1, random_w(3)), context)  # round 2 not accepted: rolled back
    assert list(context.state[STATE_ARRAYS].keys()) == ["duals"]
    assert meta(context) == {"task-id": TASK, "committed-round": 1, "pending-round": 3,
                             "stable-round": -1}
    assert np.array_equal(duals(context)[0], kept[0])


def test_client_app_reused_across_inprocess_runs_loads_new_data():
    def load(context: Context) -> tuple[np.ndarray, ...]:
        Xs, ys = make_synthetic_tasks(num_tasks=3, dim=4, samples_per_task=20,
                                      seed=int(context.run_config["data-seed"]))
        t = int(context.node_config["partition-id"])
        return Xs[t], ys[t]

    def run(client_app, data_seed: int) -> MOCHA:
        strategy = MOCHA(3, lam=0.1, discovery_timeout=1.0)
        server_app = ServerApp()

        @server_app.main()
        def main(grid, context):
            strategy.start(grid=grid, num_rounds=2, timeout=30)

        run_inprocess(server_app, client_app, 3, run_config={"data-seed": data_seed})
        return strategy

    shared = make_mocha_client_app(load)
    run(shared, 0)
    reused = run(shared, 1)
    fresh = run(make_mocha_client_app(load), 1)
    assert np.array_equal(reused.n_train, fresh.n_train)
    assert np.array_equal(reused.state.W, fresh.state.W)


# ------------------------------------------------------------------------------ the loss
@pytest.mark.parametrize("loss", ["smoothed-hinge", "logistic", "squared"])
def test_the_instruction_loss_drives_the_step_and_the_reports(app, loss):
    """``loss`` in the config: the device's SDCA steps, ``loss-mean`` and ``dual-mean`` are
    that loss's (not the hinge's)."""
    from fmtl_flower.core.losses import LOSSES

    context = make_context()
    w1, w2 = random_w(1), random_w(2)
    first = app(train_msg(1, 0, w1, loss=loss), context)
    d1, b1 = sdca_local_update(X, Y, np.zeros(N), w1, budget=N, m_tt=M_TT,
                               sigma_prime=SIGMA_P, order=coordinate_order(3, TASK, 1, N),
                               loss=loss)
    np.testing.assert_array_equal(delta_b(first), b1)
    hinge_b = expected_update(np.zeros(N), w1, 1)[1]
    assert not np.allclose(delta_b(first), hinge_b)
    second = metrics(app(train_msg(2, 1, w2, loss=loss), context))
    assert second["state-ok"] == 1
    assert second["loss-mean"] == LOSSES[loss].mean_value(X, Y, w2)
    assert second["dual-mean"] == LOSSES[loss].dual_mean(d1, Y)
    assert second["loss-mean"] != mean_hinge_loss(X, Y, w2)
    assert LOSSES[loss].feasible(duals(context)[0], Y)


def test_a_dual_of_another_loss_is_never_continued(app):
    """The dual state is bound to the loss: state written under the hinge is not resumed
    under the logistic loss (state-ok 0, alpha from 0), nor the other way round."""
    context = make_context()
    app(train_msg(1, 0, random_w(1)), context)
    assert metrics(app(train_msg(2, 1, random_w(2)), context))["state-ok"] == 1
    switched = metrics(app(train_msg(3, 2, random_w(3), loss="logistic"), context))
    assert switched["state-ok"] == 0 and switched["dual-mean"] == 0.0
    assert metrics(app(train_msg(4, 3, random_w(4), loss="logistic"), context))["state-ok"] == 1
    back = metrics(app(train_msg(5, 4, random_w(5)), context))
    assert back["state-ok"] == 0 and back["dual-mean"] == 0.0


def test_an_unknown_loss_is_an_error_reply_naming_the_losses(app):
    context = make_context()
    with pytest.raises(ValueError, match="hinge, smoothed-hinge, logistic, squared"):
        app.mocha_client.train(train_msg(1, 0, loss="cubic"), context)
    assert STATE_ARRAYS not in context.state  # nothing written
