"""FedEM's device handlers: labels, state kept on the device, unseen-client EM, bad input."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fmtl_flower.clients.fedem import (
    STATE_ARRAYS,
    STATE_META,
    FedEMClient,
    labels_as_classes,
)
from fmtl_flower.core.models import make_model
from fmtl_flower.wire import from_array, to_array

DIM, M = 4, 2


def load(context: Context) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(int(context.node_config["partition-id"]))
    X = rng.uniform(-1, 1, size=(50, DIM))
    Xt = rng.uniform(-1, 1, size=(40, DIM))
    return X, np.where(X[:, 0] > 0, 1.0, -1.0), Xt, np.where(Xt[:, 0] > 0, 1.0, -1.0)


def context(task: int = 0) -> Context:
    return Context(run_id=1, node_id=100 + task, node_config={"partition-id": task},
                   state=RecordDict(), run_config={})


def message(kind: str, task: int = 0, method: str = "fedem", unseen: bool = False,
            components: np.ndarray | None = None, rnd: int = 1) -> Message:
    if components is None:
        model = make_model("logistic", DIM)
        components = np.stack([model.init_params(np.random.default_rng(m)) for m in range(M)])
    config = ConfigRecord({"task-id": task, "server-round": rnd, "seed": 0, "method": method,
                           "model": "logistic", "num-classes": 2, "hidden": 8,
                           "batch-size": 16, "local-epochs": 1, "lr": 0.3, "momentum": 0.9,
                           "weight-decay": 5e-4, "prox-mu": 0.0, "pi-floor": 1e-6,
                           "unseen": unseen, "finetune-epochs": 1})
    content = RecordDict({"arrays": ArrayRecord({"components": to_array(components)}),
                          "config": config})
    return Message(content, dst_node_id=100 + task,
                   message_type=MessageType.TRAIN if kind == "train" else MessageType.EVALUATE)


def test_labels_mapping():
    np.testing.assert_array_equal(labels_as_classes(np.array([-1.0, 1.0, 1.0]), "t"), [0, 1, 1])
    np.testing.assert_array_equal(labels_as_classes(np.array([0.0, 1.0, 2.0]), "t"), [0, 1, 2])
    np.testing.assert_array_equal(labels_as_classes(np.array([1.0, 1.0]), "t"), [1, 1])
    for bad in ([0.5, 1.0], [-2.0, 1.0], [np.nan, 1.0]):
        with pytest.raises(ValueError, match="t:"):
            labels_as_classes(np.array(bad), "t")


def test_train_keeps_pi_and_momentum_on_the_device_only():
    client, ctx = FedEMClient(load), context()
    reply = client.train(message("train"), ctx)
    assert set(reply.content["arrays"].keys()) == {"components", "weights", "responsibility"}
    pi = from_array(ctx.state[STATE_ARRAYS]["pi"])
    assert pi.shape == (M,) and pi.sum() == pytest.approx(1.0)
    assert np.any(from_array(ctx.state[STATE_ARRAYS]["momentum"]) != 0)
    metrics = reply.content["metrics"]
    assert metrics["task-id"] == 0 and metrics["n-train"] == 50 and metrics["train-loss"] > 0


def test_corrupted_state_is_rejected_and_reset(caplog):
    client, ctx = FedEMClient(load), context()
    client.train(message("train"), ctx)
    arrays = ctx.state[STATE_ARRAYS]
    ctx.state[STATE_ARRAYS] = ArrayRecord({"pi": to_array(np.array([0.9, 0.9])),
                                           "momentum": arrays["momentum"]})
    with caplog.at_level(logging.WARNING, logger="flwr"):
        client.train(message("train", rnd=2), ctx)
    assert "stored state rejected" in caplog.text and "simplex" in caplog.text
    assert from_array(ctx.state[STATE_ARRAYS]["pi"]).sum() == pytest.approx(1.0)


def test_state_from_another_setting_is_not_mixed():
    client, ctx = FedEMClient(load), context()
    client.train(message("train"), ctx)
    assert ctx.state[STATE_META]["signature"].startswith("fedem|2|")
    one = message("train", method="fedavg", components=np.zeros((1, DIM + 1)), rnd=2)
    client.train(one, ctx)
    assert from_array(ctx.state[STATE_ARRAYS]["momentum"]).shape == (1, DIM + 1)


def test_unseen_client_fits_pi_by_em_at_evaluation():
    client = FedEMClient(load)
    good = np.zeros(DIM + 1)
    good[0] = 8.0
    components = np.stack([-good, good])  # component 1 explains the labels
    reply = client.evaluate(message("evaluate", unseen=True, components=components), context())
    metrics = reply.content["metrics"]
    assert metrics["em-iterations"] > 1
    assert metrics["test-correct"] >= 0.9 * metrics["test-n"]
    seen = client.evaluate(message("evaluate", task=1, components=components), context(1))
    assert seen.content["metrics"]["em-iterations"] == 0  # uniform pi, never trained


def test_bad_messages_raise_clear_errors():
    client = FedEMClient(load)
    with pytest.raises(ValueError, match="reached task 0"):
        client.train(message("train", task=3), context())
    bad = message("train")
    bad.content["config"]["method"] = "fedsgd"
    with pytest.raises(ValueError, match="unknown method"):
        client.train(bad, context())
    nan = message("train", components=np.full((M, DIM + 1), np.nan))
    with pytest.raises(ValueError):
        client.train(nan, context())
    wrong = message("train", components=np.zeros((M, DIM + 3)))
    with pytest.raises(ValueError):
        client.train(wrong, context())


def test_whoami_reports_classes():
    client = FedEMClient(load)
    query = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=100,
                    message_type=f"{MessageType.QUERY}.whoami")
    info = client.whoami(query, context()).content["info"]
    assert info["num-classes"] == 2 and info["dim"] == DIM and info["n-train"] == 50
