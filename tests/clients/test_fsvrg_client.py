"""FSVRG's ClientApp handlers called directly: replies equal the core functions' outputs."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fmtl_flower.clients.fsvrg import FsvrgClient
from fmtl_flower.core.fsvrg import (
    fsvrg_local_pass,
    local_error_count,
    local_loss_grad_sums,
    node_feature_counts,
    node_scaling,
)
from fmtl_flower.core.rng import coordinate_order
from fmtl_flower.data.sparse_federated import make_sparse_task
from fmtl_flower.wire import from_array, to_array

DIM = 500
TASK = 2


@pytest.fixture(scope="module")
def task():
    return make_sparse_task(TASK, dim=DIM, seed=0)


def context() -> Context:
    return Context(run_id=1, node_id=7, node_config={"partition-id": TASK}, state=RecordDict(),
                   run_config={})


def message(kind: str, config: dict, arrays: dict | None = None) -> Message:
    content = {"config": ConfigRecord(config)}
    if arrays is not None:
        content["arrays"] = ArrayRecord({k: to_array(v) for k, v in arrays.items()})
    return Message(RecordDict(content), dst_node_id=7, message_type=kind)


def test_handlers_match_core(task):
    client = FsvrgClient(lambda ctx: task.arrays())
    ctx = context()
    info = client.whoami(message(f"{MessageType.QUERY}.whoami", {}), ctx).content["info"]
    assert (info["task-id"], info["n-train"], info["dim"]) == (TASK, task.n_train, DIM)

    stats = client.stats(message(f"{MessageType.QUERY}.fsvrg_stats", {"task-id": TASK}), ctx)
    counts = from_array(stats.content["arrays"]["counts"])
    assert np.array_equal(counts, node_feature_counts(task.X_train)[1])

    rng = np.random.default_rng(0)
    w, g = rng.normal(size=DIM), rng.normal(size=DIM) * 0.1
    reply = client.gradient(message(f"{MessageType.QUERY}.fsvrg_gradient",
                                    {"task-id": TASK, "server-round": 1, "eval": True},
                                    {"w": w}), ctx)
    loss, grad = local_loss_grad_sums(task.X_train, task.y_train, w)
    assert reply.content["metrics"]["loss-sum"] == loss
    assert np.array_equal(from_array(reply.content["arrays"]["grad-sum"]), grad)
    wrong, n_test = local_error_count(task.X_test, task.y_test, w)
    assert (reply.content["metrics"]["test-errors"], reply.content["metrics"]["test-n"]) == (
        wrong, n_test)

    phi = np.clip(counts / task.n_train * 0.5, 0.0, 1.0)
    reply = client.train(message(MessageType.TRAIN,
                                 {"task-id": TASK, "server-round": 2, "seed": 5,
                                  "method": "fsvrg", "lam": 0.01, "h": 4.0},
                                 {"w": w, "g": g, "phi": phi}), ctx)
    expected = fsvrg_local_pass(task.X_train, task.y_train, w, g, lam=0.01, h=4.0,
                                s=node_scaling(phi, task.n_train, counts),
                                order=coordinate_order(5, TASK, 2, task.n_train))
    assert np.array_equal(from_array(reply.content["arrays"]["w-local"]), expected)
    assert reply.content["metrics"]["round"] == 2


def test_bad_instructions_raise(task):
    client = FsvrgClient(lambda ctx: task.arrays())
    ctx = context()
    with pytest.raises(ValueError, match="task"):
        client.stats(message(f"{MessageType.QUERY}.fsvrg_stats", {"task-id": TASK + 1}), ctx)
    with pytest.raises(ValueError, match="'w'"):
        client.gradient(message(f"{MessageType.QUERY}.fsvrg_gradient",
                                {"task-id": TASK, "server-round": 1},
                                {"w": np.full(DIM, np.nan)}), ctx)
    with pytest.raises(ValueError, match="method"):
        client.train(message(MessageType.TRAIN,
                             {"task-id": TASK, "server-round": 1, "seed": 0, "method": "dane",
                              "lam": 0.1, "h": 1.0},
                             {"w": np.zeros(DIM), "g": np.zeros(DIM)}), ctx)
