"""FSVRG's ClientApp handlers called directly: replies equal the core functions' outputs, and
CoCoA+'s dual commit protocol (commit, roll back, restart) on the node."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fmtl_flower.clients.fsvrg import COCOA_STATE_ARRAYS, COCOA_STATE_META, FSVRGClient
from fmtl_flower.core.fsvrg import (
    cocoa_plus_local_sdca,
    dane_epoch_orders,
    dane_local_solve,
    fsvrg_local_pass,
    local_error_count,
    local_loss_grad_sums,
    logistic_dual_sum,
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
    client = FSVRGClient(lambda ctx: task.arrays())
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
    client = FSVRGClient(lambda ctx: task.arrays())
    ctx = context()
    with pytest.raises(ValueError, match="task"):
        client.stats(message(f"{MessageType.QUERY}.fsvrg_stats", {"task-id": TASK + 1}), ctx)
    with pytest.raises(ValueError, match="'w'"):
        client.gradient(message(f"{MessageType.QUERY}.fsvrg_gradient",
                                {"task-id": TASK, "server-round": 1},
                                {"w": np.full(DIM, np.nan)}), ctx)
    with pytest.raises(ValueError, match="method"):
        client.train(message(MessageType.TRAIN,
                             {"task-id": TASK, "server-round": 1, "seed": 0, "method": "sgd",
                              "lam": 0.1, "h": 1.0},
                             {"w": np.zeros(DIM), "g": np.zeros(DIM)}), ctx)
    with pytest.raises(ValueError, match="DANE needs"):
        client.train(message(MessageType.TRAIN,
                             {"task-id": TASK, "server-round": 1, "seed": 0, "method": "dane",
                              "lam": 0.1, "mu": 0.0, "epochs": 0},
                             {"w": np.zeros(DIM), "g": np.zeros(DIM)}), ctx)
    with pytest.raises(ValueError, match="last-accepted-round"):
        client.train(cocoa_train(2, 2, np.zeros(DIM)), ctx)
    with pytest.raises(ValueError, match="'w'"):
        client.train(cocoa_train(1, 0, np.full(DIM, np.inf)), ctx)
    assert len(ctx.state) == 0  # nothing written by a failed call


def test_dane_handler_matches_core(task):
    client = FSVRGClient(lambda ctx: task.arrays())
    rng = np.random.default_rng(1)
    w, g = rng.normal(size=DIM) * 0.1, rng.normal(size=DIM) * 0.01
    config = {"task-id": TASK, "server-round": 3, "seed": 4, "method": "dane", "lam": 0.01,
              "mu": 0.1, "epochs": 2}
    reply = client.train(message(MessageType.TRAIN, config, {"w": w, "g": g}), context())
    expected = dane_local_solve(task.X_train, task.y_train, w, g, lam=0.01, mu=0.1,
                                orders=dane_epoch_orders(4, TASK, 3, task.n_train, 2))
    assert np.array_equal(from_array(reply.content["arrays"]["w-local"]), expected)
    reply = client.train(message(MessageType.TRAIN, {**config, "step": 0.05}, {"w": w, "g": g}),
                         context())
    expected = dane_local_solve(task.X_train, task.y_train, w, g, lam=0.01, mu=0.1, step=0.05,
                                orders=dane_epoch_orders(4, TASK, 3, task.n_train, 2))
    assert np.array_equal(from_array(reply.content["arrays"]["w-local"]), expected)


# ------------------------------------------------------------------------------ CoCoA+
LAM, N_GLOBAL, SIGMA = 0.01, 5000, 10.0


def cocoa_train(server_round: int, last_accepted: int, w: np.ndarray,
                epochs: int = 1) -> Message:
    return message(MessageType.TRAIN,
                   {"task-id": TASK, "server-round": server_round, "seed": 3,
                    "method": "cocoa-plus", "lam": LAM, "n": N_GLOBAL, "sigma-prime": SIGMA,
                    "epochs": epochs, "last-accepted-round": last_accepted, "eval": False},
                   {"w": w})


def sdca(task, alpha: np.ndarray, w: np.ndarray, server_round: int) -> tuple:
    return cocoa_plus_local_sdca(task.X_train, task.y_train, alpha, w, lam=LAM, n=N_GLOBAL,
                                 sigma_prime=SIGMA,
                                 order=coordinate_order(3, TASK, server_round, task.n_train))


def reply_parts(reply: Message) -> tuple[int, float, np.ndarray]:
    m = reply.content["metrics"]
    return m["state-ok"], m["dual-sum"], from_array(reply.content["arrays"]["d-w"])


def test_cocoa_plus_commit_rollback_and_restart(task):
    client = FSVRGClient(lambda ctx: task.arrays())
    ctx = context()
    rng = np.random.default_rng(2)
    w1, w2, w3, w4 = (rng.normal(size=DIM) * 0.1 for _ in range(4))
    # round 1: nothing accepted yet; alpha = 0
    ok, dual, d_w = reply_parts(client.train(cocoa_train(1, 0, w1), ctx))
    da1, dw1 = sdca(task, np.zeros(task.n_train), w1, 1)
    assert (ok, dual) == (1, 0.0) and np.array_equal(d_w, dw1)
    # round 2: round 1 accepted -> commit
    reply = client.train(cocoa_train(2, 1, w2), ctx)
    ok, dual, d_w = reply_parts(reply)
    da2, dw2 = sdca(task, da1, w2, 2)
    assert ok == 1 and dual == logistic_dual_sum(task.y_train, da1)
    assert np.array_equal(d_w, dw2)
    loss, _ = local_loss_grad_sums(task.X_train, task.y_train, w2)
    assert reply.content["metrics"]["loss-sum"] == loss
    # round 3: round 2's reply was rejected (L stays 1) -> roll back to alpha = da1
    ok, dual, d_w = reply_parts(client.train(cocoa_train(3, 1, w3), ctx))
    _, dw3 = sdca(task, da1, w3, 3)
    assert ok == 1 and dual == logistic_dual_sum(task.y_train, da1)
    assert np.array_equal(d_w, dw3)
    # round 4: the server claims round 2, which the node dropped -> restart from 0
    ok, dual, d_w = reply_parts(client.train(cocoa_train(4, 2, w4), ctx))
    _, dw4 = sdca(task, np.zeros(task.n_train), w4, 4)
    assert (ok, dual) == (0, 0.0) and np.array_equal(d_w, dw4)
    meta = ctx.state[COCOA_STATE_META]
    assert (meta["committed-round"], meta["pending-round"]) == (0, 4)
    # evaluate after round 4 was accepted: commit, report, keep nothing pending
    reply = client.evaluate(message(MessageType.EVALUATE,
                                    {"task-id": TASK, "server-round": 4, "eval": True,
                                     "method": "cocoa-plus", "last-accepted-round": 4},
                                    {"w": w4}), ctx)
    da4 = sdca(task, np.zeros(task.n_train), w4, 4)[0]
    assert reply.content["metrics"]["state-ok"] == 1
    assert reply.content["metrics"]["dual-sum"] == logistic_dual_sum(task.y_train, da4)
    assert "test-n" in reply.content["metrics"] and "arrays" not in reply.content
    meta = ctx.state[COCOA_STATE_META]
    assert (meta["committed-round"], meta["pending-round"]) == (4, -1)
    assert np.array_equal(from_array(ctx.state[COCOA_STATE_ARRAYS]["duals"])[0], da4)


def test_cocoa_plus_empty_state_with_accepted_rounds_restarts(task):
    client = FSVRGClient(lambda ctx: task.arrays())
    ok, dual, d_w = reply_parts(client.train(cocoa_train(5, 3, np.zeros(DIM)), context()))
    assert (ok, dual) == (0, 0.0)
    assert np.array_equal(d_w, sdca(task, np.zeros(task.n_train), np.zeros(DIM), 5)[1])


def test_cocoa_plus_local_epochs_concatenate_the_epoch_orders(task):
    client = FSVRGClient(lambda ctx: task.arrays())
    w = np.full(DIM, 0.01)
    _, _, d_w = reply_parts(client.train(cocoa_train(2, 0, w, epochs=3), context()))
    order = np.concatenate(dane_epoch_orders(3, TASK, 2, task.n_train, 3))
    _, expected = cocoa_plus_local_sdca(task.X_train, task.y_train, np.zeros(task.n_train), w,
                                        lam=LAM, n=N_GLOBAL, sigma_prime=SIGMA, order=order)
    assert np.array_equal(d_w, expected)
