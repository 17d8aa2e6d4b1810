"""OFMTL's newcomer handlers: the dual state continues across steps, a lagging state restarts,
and the reply is the closed-form w of the subproblem."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fmtl_flower.clients.ofmtl import STATE_ARRAYS, OFMTLClient
from fmtl_flower.core.ofmtl import newcomer_fit, newcomer_model
from fmtl_flower.wire import from_array, to_array

D = 4


def load(context: Context):
    rng = np.random.default_rng(7)
    X = rng.normal(size=(30, D))
    y = np.where(X[:, 1] > 0, 1.0, -1.0)
    return X, y, X[:10], y[:10]


def ctx() -> Context:
    return Context(run_id=1, node_id=5, node_config={"partition-id": 3}, state=RecordDict(),
                   run_config={})


def step_msg(step: int, c: np.ndarray, omega: float = 2.0) -> Message:
    config = ConfigRecord({"task-id": 3, "step": step, "inner-rounds": 5, "seed": 1,
                           "omega": omega, "lambda": 0.1, "local-frac": 0.5})
    return Message(RecordDict({"arrays": ArrayRecord({"c": to_array(c)}), "config": config}),
                   dst_node_id=5, message_type="train.ofmtl")


def test_steps_continue_the_dual_and_match_the_core_fit():
    client, context = OFMTLClient(load), ctx()
    c = np.array([0.1, -0.2, 0.0, 0.3])
    first = client.newcomer(step_msg(0, c), context)
    second = client.newcomer(step_msg(1, c), context)
    assert second.content["metrics"]["state-ok"] == 1
    X, y, _, _ = load(context)
    ref = newcomer_fit(X, y, omega=2.0, c=c, lam=0.1, rounds=10, local_frac=0.5, seed=1,
                       task_id=3)
    np.testing.assert_allclose(from_array(second.content["arrays"]["w"]), ref.w, rtol=1e-12)
    np.testing.assert_allclose(from_array(context.state[STATE_ARRAYS]["alpha"]), ref.alpha)
    w1 = from_array(first.content["arrays"]["w"])
    alpha = from_array(context.state[STATE_ARRAYS]["alpha"])
    np.testing.assert_allclose(newcomer_model(X, alpha, omega=2.0, c=c, lam=0.1),
                               from_array(second.content["arrays"]["w"]))
    assert not np.allclose(w1, ref.w)
    assert second.content["metrics"]["gap"] >= 0


def test_lagging_state_restarts_and_says_so():
    client = OFMTLClient(load)
    reply = client.newcomer(step_msg(2, np.zeros(D)), ctx())  # no step 1 stored
    assert reply.content["metrics"]["state-ok"] == 0


def test_bad_inputs_are_errors():
    client = OFMTLClient(load)
    with pytest.raises(ValueError, match="'c'"):
        client.newcomer(step_msg(0, np.zeros(D + 1)), ctx())
    with pytest.raises(ValueError, match="'c'"):
        client.newcomer(step_msg(0, np.full(D, np.nan)), ctx())
    msg = step_msg(0, np.zeros(D))
    msg.content["config"]["task-id"] = 9
    with pytest.raises(ValueError, match="reached task 3"):
        client.newcomer(msg, ctx())


def test_evaluate_model_reports_test_errors():
    client = OFMTLClient(load)
    w = np.array([0.0, 1.0, 0.0, 0.0])
    msg = Message(RecordDict({"arrays": ArrayRecord({"w": to_array(w)}),
                              "config": ConfigRecord({"task-id": 3, "server-round": 4})}),
                  dst_node_id=5, message_type="evaluate.ofmtl")
    metrics = client.evaluate_model(msg, ctx()).content["metrics"]
    assert metrics["test-errors"] == 0 and metrics["test-n"] == 10 and metrics["round"] == 4
