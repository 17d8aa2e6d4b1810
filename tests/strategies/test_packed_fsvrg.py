"""The FSVRG family's stacked messages (strategies/packed_fsvrg.py, clients/packed_fsvrg.py):
one message per packed node and exchange, results bit for bit those of one task per node
(every method; CoCoA+ with rejected replies, lost device state and a resumed server), and a
malformed slot or row failing only its task."""

from __future__ import annotations

import logging
import math
from collections import Counter

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.apps.common import dataset_for, make_client_app, make_server_app
from fmtl_flower.clients.fsvrg import make_fsvrg_client_app
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.clients.packed_fsvrg import STATE, PackedFSVRG
from fmtl_flower.config import RunConfig
from fmtl_flower.data.sparse_federated import make_sparse_federated
from fmtl_flower.engine import run_inprocess
from fmtl_flower.packing import PackedGrid, packed_client_app, tasks_of_node
from fmtl_flower.strategies.fsvrg import FSVRG
from fmtl_flower.wire import from_array, to_array

from .helpers import ServerKilled, killed_in

BASE = {"dataset": "sparse-federated", "num-tasks": 10, "dim": 300, "num-server-rounds": 3,
        "eval-every": 2}
METHODS = {"fsvrg": {}, "fsvrg-naive": {"fsvrg.h": 0.05}, "gd": {},
           "dane": {"fsvrg.local-epochs": 2, "fsvrg.dane-mu": 0.1},
           "cocoa-plus": {"fsvrg.local-epochs": 2}}
EXCHANGES = ("query.fsvrg_stats", "query.fsvrg_gram", "query.fsvrg_gradient", "train",
             "evaluate")


@pytest.fixture(autouse=True)
def _quiet_flower():
    logging.getLogger("flwr").setLevel(logging.WARNING)


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.endswith("_s")}


def _run(values: dict, seen: list | None = None, app_wrap=None) -> dict:
    cfg = RunConfig.from_mapping(values)
    box: dict = {}
    client = make_client_app(cfg)

    def app(message, context):
        if seen is not None:
            seen.append((message.metadata.message_type, "stack" in message.content))
        return (app_wrap or (lambda c, m, x: c(m, x)))(client, message, context)

    run_inprocess(make_server_app(cfg, on_done=box.update), app,
                  math.ceil(cfg.num_tasks / cfg.tasks_per_node))
    return box


def _same_results(one: dict, packed: dict) -> None:
    assert [_untimed(r) for r in one["rounds"]] == [_untimed(r) for r in packed["rounds"]]
    assert _untimed(one["final"]) == _untimed(packed["final"])


@pytest.mark.parametrize("method", sorted(METHODS))
def test_stacked_runs_equal_unpacked_runs_bit_for_bit(method):
    values = {**BASE, "strategy": method, **METHODS[method]}
    seen_one: list = []
    one = _run({**values, "tasks-per-node": 1}, seen_one)
    seen: list = []
    packed = _run({**values, "tasks-per-node": 4}, seen)  # 3 nodes: 4 + 4 + 2 tasks
    _same_results(one, packed)
    assert one["final"]["complete"] and one["final"]["objective"] is not None
    # every exchange went stacked, one message per node: 10 tasks -> 3 messages
    exchanges = Counter(kind for kind, _ in seen if kind in EXCHANGES)
    assert all(stacked for kind, stacked in seen if kind in EXCHANGES)
    unpacked = Counter(kind for kind, _ in seen_one if kind in EXCHANGES)
    assert set(exchanges) == set(unpacked) and "evaluate" in exchanges
    for kind, count in unpacked.items():
        assert count % 10 == 0 and exchanges[kind] == count // 10 * 3, kind
    assert Counter(kind for kind, _ in seen)["query.whoami"] == 3


def _task_ids(message: Message) -> list[int]:
    if "stack" in message.content:
        return from_array(message.content["arrays"]["task-id"]).tolist()
    return [int(message.content["config"]["task-id"])]


def _round(message: Message) -> int:
    return int(message.content["config"].get("server-round", 0))


def _faulty(bad: dict[int, set[int]], lose_state: dict[int, set[int]]):
    """A client wrapper: the train replies of round r of the tasks ``bad[r]`` fail (an error
    reply, or the slot in ``stack-errors``); before round r's train, the nodes of the tasks
    ``lose_state[r]`` lose their device state."""
    def wrap(client, message, context):
        if message.metadata.message_type != "train":
            return client(message, context)
        tasks = _task_ids(message)
        if set(tasks) & lose_state.get(_round(message), set()):
            for key in list(context.state.keys()):
                del context.state[key]
        reply = client(message, context)
        failing = set(tasks) & bad.get(_round(message), set())
        if not failing:
            return reply
        if "stack" not in message.content:
            return Message(Error(code=0, reason="lost"), reply_to=message)
        return _drop_rows(reply, failing)
    return wrap


def _drop_rows(reply: Message, tasks: set[int]) -> Message:
    """The stacked reply without the rows of ``tasks`` (their slots failed)."""
    arrays = reply.content["arrays"]
    ids = from_array(arrays["task-id"]).tolist()
    keep = [i for i, t in enumerate(ids) if t not in tasks]
    slots = reply.content["stack"]["slots"]
    failed = [s for i, s in enumerate(slots) if i not in keep]
    reply.content["stack"] = ConfigRecord({"protocol": "fsvrg",
                                           "slots": [slots[i] for i in keep]})
    reply.content["stack-errors"] = ConfigRecord({"slots": failed,
                                                  "reasons": ["lost"] * len(failed)})
    reply.content["arrays"] = ArrayRecord({k: to_array(from_array(v)[keep])
                                           for k, v in arrays.items()})
    return reply


def test_cocoa_plus_with_failed_replies_and_lost_state_equals_the_unpacked_run():
    """Rejected rows roll their slots back at the next message, a node that loses its stacked
    state resets its tasks (state-ok = 0): the same records as one task per node."""
    values = {**BASE, "strategy": "cocoa-plus", "num-server-rounds": 5, "eval-every": 1}
    wrap = _faulty({2: {1, 6}, 3: {6, 9}}, {4: {4, 5, 6, 7}})  # node 1 hosts tasks 4..7
    one = _run({**values, "tasks-per-node": 1}, app_wrap=wrap)
    packed = _run({**values, "tasks-per-node": 4}, app_wrap=wrap)
    _same_results(one, packed)
    rounds = packed["rounds"]
    assert [r["num_replies"] for r in rounds[1:]] == [10, 8, 8, 10, 10]
    assert [r["num_resets"] for r in rounds] == [None, 0, 0, 0, 4, 0]
    assert rounds[1]["tasks_missing"] == [1, 6] and rounds[3]["gap"] is None
    assert all(r["gap"] >= 0 for r in rounds if r["gap"] is not None)


# ------------------------------------------------------------------ strategies directly
@pytest.fixture(scope="module")
def data():
    return make_sparse_federated(num_tasks=7, dim=400, seed=3)


def _federate(data, strategy: FSVRG, per_node: int, rounds: int, state_dir=None) -> None:
    """``strategy`` over ``data`` on ceil(m / per_node) nodes (packed and stacked when
    per_node > 1), as the package's apps do it."""
    app = make_fsvrg_client_app(lambda ctx: data.task(default_task_id(ctx)).arrays(),
                                state_dir=None if state_dir is None else str(state_dir))
    if per_node > 1:
        stacked = PackedFSVRG(app.fsvrg_client)
        app = packed_client_app(
            app, lambda ctx: tasks_of_node(ctx.node_config, per_node, data.num_tasks),
            {"fsvrg": stacked}, {"query.whoami": stacked.whoami})
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=PackedGrid(grid) if per_node > 1 else grid, num_rounds=rounds,
                       timeout=60.0)

    run_inprocess(server_app, app, math.ceil(data.num_tasks / per_node))


@pytest.mark.parametrize("method", ["cocoa-plus", "fsvrg"])
def test_a_resumed_packed_server_ends_where_the_unpacked_run_ends(data, tmp_path, method):
    """Server killed in round 4 with checkpoints every 2 rounds, resumed: CoCoA+'s slots go
    back to their stable copies (checkpoint-round) in the stacked state: bit for bit the
    uninterrupted unpacked run."""
    options = {"method": method, "seed": 2, "discovery_timeout": 5.0}
    plain = FSVRG(data.num_tasks, **options)
    _federate(data, plain, 1, 6)
    first = killed_in(FSVRG, 4)(data.num_tasks, **options)
    first.enable_checkpoints(tmp_path / "ckpt", every=2)
    with pytest.raises(ServerKilled):
        _federate(data, first, 3, 6, tmp_path / "devices")
    resumed = FSVRG(data.num_tasks, **options)
    resumed.enable_checkpoints(tmp_path / "ckpt", every=2)
    _federate(data, resumed, 3, 6, tmp_path / "devices")
    assert resumed.resumed_from == 2
    np.testing.assert_array_equal(resumed.w, plain.w)
    got, want = resumed.results(), plain.results()
    assert [_untimed(r) for r in got["rounds"]] == [_untimed(r) for r in want["rounds"]]
    if method == "cocoa-plus":  # nobody reset: the slots went back to round 2's duals
        assert all(r["num_resets"] in (None, 0) for r in got["rounds"])
        assert sorted(p.name for p in (tmp_path / "devices").glob("cocoa-plus-task-*")) == \
            [f"cocoa-plus-task-{t}.npz" for t in range(data.num_tasks)]


def test_a_malformed_row_of_a_stacked_reply_rejects_only_its_task(caplog):
    values = {**BASE, "strategy": "fsvrg", "tasks-per-node": 4}

    def corrupt(client, message, context):
        reply = client(message, context)
        kind = message.metadata.message_type
        if "stack" not in message.content or kind not in ("query.fsvrg_gradient", "train"):
            return reply
        arrays = reply.content["arrays"]
        tasks = from_array(arrays["task-id"]).tolist()
        key = "grad-sum" if kind == "query.fsvrg_gradient" else "w-local"
        if 6 in tasks:  # task 6's vector is not finite
            matrix = np.array(from_array(arrays[key]))
            matrix[tasks.index(6), 0] = np.inf
            arrays[key] = to_array(matrix)
        if 1 in tasks:  # task 1's row claims another task
            ids = np.array(from_array(arrays["task-id"]))
            ids[tasks.index(1)] = 2
            arrays["task-id"] = to_array(ids)
        if 8 in tasks and kind == "query.fsvrg_gradient":  # task 8's loss is negative
            loss = np.array(from_array(arrays["loss-sum"]))
            loss[tasks.index(8)] = -1.0
            arrays["loss-sum"] = to_array(loss)
        return reply

    with caplog.at_level(logging.WARNING, logger="flwr"):
        box = _run(values, app_wrap=corrupt)
    assert "reply of task 6 (node" in caplog.text and "non-finite" in caplog.text
    assert "reply of task 1 (node" in caplog.text and "reply of task 8 (node" in caplog.text
    assert [r["num_replies"] for r in box["rounds"][1:]] == [8, 8, 8]
    assert [r["tasks_missing"] for r in box["rounds"][:3]] == [[1, 6, 8]] * 3
    assert np.isfinite(box["final"]["objective"])

    def lose(client, message, context):  # the same replies lost instead
        reply = client(message, context)
        kind = message.metadata.message_type
        if "stack" not in message.content or kind not in ("query.fsvrg_gradient", "train"):
            return reply
        return _drop_rows(reply, {1, 6, 8} if kind != "train" else {1, 6})

    lost = _run(values, app_wrap=lose)
    _same_results(lost, box)


def test_a_malformed_stacked_reply_rejects_its_nodes_tasks_only(caplog):
    values = {**BASE, "strategy": "gd", "tasks-per-node": 4}

    def corrupt(client, message, context):
        reply = client(message, context)
        if "stack" in message.content and 4 in _task_ids(message) \
                and message.metadata.message_type == "query.fsvrg_gradient" \
                and _round(message) == 2:
            del reply.content["arrays"]["n-train"]  # node 1's whole reply is malformed
        return reply

    with caplog.at_level(logging.WARNING, logger="flwr"):
        box = _run(values, app_wrap=corrupt)
    assert "malformed stacked reply: array 'n-train' missing" in caplog.text
    assert box["rounds"][1]["tasks_missing"] == [4, 5, 6, 7]
    assert box["rounds"][2]["num_replies"] == 6  # GD's step from the 6 other tasks
    assert box["final"]["complete"]


# ------------------------------------------------------------------ the handler itself
@pytest.fixture()
def message_identity(monkeypatch):
    """``Message(...)`` needs Flower's TaskIdentity (``InProcessGrid.__init__`` sets the same);
    without it these tests would pass only after another test had run a federation."""
    from flwr.supercore.task_identity import TaskIdentity

    for key, value in (("_run_id", 1), ("_node_id", 1), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, key, value)


def _node(method: str = "fsvrg"):
    cfg = RunConfig.from_mapping({**BASE, "strategy": method, "tasks-per-node": 4})
    return dataset_for(cfg), make_client_app(cfg)


def test_a_stacked_reply_holds_the_unpacked_replies_and_a_bad_slot_fails_alone(
        message_identity):
    data, packed_app = _node()
    _, one_app = _node()
    rng = np.random.default_rng(0)
    w, g = rng.normal(size=data.dim) * 0.01, rng.normal(size=data.dim) * 0.01
    phi = np.ones(data.dim)
    config = {"server-round": 2, "seed": 3, "method": "fsvrg", "lam": 0.01, "h": 4.0}
    arrays = {"w": to_array(w), "g": to_array(g), "phi": to_array(phi)}
    ctx = Context(run_id=1, node_id=1001, node_config={"partition-id": 1},
                  state=RecordDict(), run_config={})
    stacked = Message(RecordDict({
        "stack": ConfigRecord({"protocol": "fsvrg", "slots": [0, 1, 2, 3]}),
        "config": ConfigRecord(config),
        "arrays": ArrayRecord({**arrays, "task-id": to_array(np.array([4, 5, 99, 7]))})}),
        dst_node_id=1001, message_type="train")
    reply = packed_app(stacked, ctx)
    assert reply.content["stack"]["slots"] == [0, 1, 3]
    assert reply.content["stack-errors"]["slots"] == [2]
    assert "task 99 reached the slot of task 6" in reply.content["stack-errors"]["reasons"][0]
    out = reply.content["arrays"]
    for row, task in enumerate([4, 5, 7]):
        one_ctx = Context(run_id=1, node_id=2000 + task, node_config={"partition-id": task},
                          state=RecordDict(), run_config={})
        one = one_app(Message(RecordDict({"config": ConfigRecord({**config, "task-id": task}),
                                          "arrays": ArrayRecord(arrays)}),
                              dst_node_id=1001, message_type="train"), one_ctx)
        for key, value in one.content["metrics"].items():
            assert from_array(out[key])[row].item() == value, key
        np.testing.assert_array_equal(from_array(out["w-local"])[row],
                                      from_array(one.content["arrays"]["w-local"]))
    # a shared vector of the wrong shape fails every slot, not the node
    stacked.content["arrays"]["g"] = to_array(np.zeros(3))
    reply = packed_app(stacked, ctx)
    assert reply.content["stack"]["slots"] == []
    assert "'g' must be finite float64" in reply.content["stack-errors"]["reasons"][0]
    assert from_array(reply.content["arrays"]["w-local"]).shape == (0, data.dim)


def test_cocoa_plus_slots_keep_one_stacked_state_record(message_identity):
    data, packed_app = _node("cocoa-plus")
    config = {"server-round": 1, "seed": 3, "method": "cocoa-plus", "lam": 0.01,
              "n": 1000, "sigma-prime": 10.0, "epochs": 1, "eval": False}
    ctx = Context(run_id=1, node_id=1001, node_config={"partition-id": 0},
                  state=RecordDict(), run_config={})

    def train(server_round: int, last_accepted: list[int]):
        return Message(RecordDict({
            "stack": ConfigRecord({"protocol": "fsvrg", "slots": [0, 1, 2, 3]}),
            "config": ConfigRecord({**config, "server-round": server_round}),
            "arrays": ArrayRecord({"w": to_array(np.zeros(data.dim)),
                                   "task-id": to_array(np.arange(4)),
                                   "last-accepted-round": to_array(np.array(last_accepted))})}),
            dst_node_id=1001, message_type="train")

    reply = packed_app(train(1, [0, 0, 0, 0]), ctx)
    assert reply.content["stack"]["slots"] == [0, 1, 2, 3]
    assert list(ctx.state.keys()) == [STATE]  # one record for every slot
    # round 2: tasks 0, 2 and 3 accepted round 1 (their slots commit it), task 1 did not (its
    # slot rolls round 1 back and stays consistent: state-ok 1 for all)
    reply = packed_app(train(2, [1, 0, 1, 1]), ctx)
    assert from_array(reply.content["arrays"]["state-ok"]).tolist() == [1, 1, 1, 1]
    # round 3: task 1 claims round 1, which its slot rolled back (restarts: state-ok 0)
    reply = packed_app(train(3, [2, 1, 2, 2]), ctx)
    assert from_array(reply.content["arrays"]["state-ok"]).tolist() == [1, 0, 1, 1]


def test_fmtl_run_packs_fsvrg_automatically_and_says_so(tmp_path, capsys):
    import json

    from fmtl_flower.cli import main

    args = ["run", "cocoa-plus", "--dataset", "sparse-federated", "--rounds", "2", "--set",
            "num-tasks=6", "--set", "dim=300"]
    assert main([*args, "--out", str(tmp_path / "auto.json")]) == 0
    assert "task packing: 6 tasks on 1 node, 6 per node (automatic" in capsys.readouterr().out
    assert main([*args, "--set", "tasks-per-node=1", "--out", str(tmp_path / "one.json")]) == 0
    auto, one = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("auto", "one"))
    assert auto["config"]["tasks-per-node"] == 6
    assert [_untimed(r) for r in auto["rounds"]] == [_untimed(r) for r in one["rounds"]]


def test_the_flwr_run_apps_stack_fsvrg_too(tmp_path):
    """``flwr run``'s ServerApp and ClientApp (handlers picked from the run config) stack
    every exchange on packed nodes: the records of one task per node."""
    import json

    from fmtl_flower.apps.client_app import app as flwr_run_client_app
    from fmtl_flower.apps.server_app import app as flwr_run_server_app

    seen: list = []

    def spy(message, context):
        seen.append((message.metadata.message_type, "stack" in message.content))
        return flwr_run_client_app(message, context)

    out = tmp_path / "res.json"
    values = {**BASE, "strategy": "cocoa-plus", "num-tasks": 9}
    run_inprocess(flwr_run_server_app, spy, 3,
                  run_config={**values, "tasks-per-node": 4, "results-file": str(out)})
    assert all(stacked for kind, stacked in seen if kind in EXCHANGES)
    assert Counter(kind for kind, _ in seen)["train"] == 3 * 3  # 3 nodes, 3 rounds
    packed = json.loads(out.read_text())
    one = _run({**values, "tasks-per-node": 1})
    assert [_untimed(r) for r in packed["rounds"]] == [_untimed(r) for r in one["rounds"]]
