"""Task packing: one node hosts several tasks, one message per node; results do not change."""

import logging
import math

import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fmtl_flower.apps.client_app import app as flwr_run_client_app
from fmtl_flower.apps.common import make_client_app, make_server_app
from fmtl_flower.apps.server_app import app as flwr_run_server_app
from fmtl_flower.config import RunConfig
from fmtl_flower.engine import InProcessGrid, run_inprocess
from fmtl_flower.packing import (
    SLOTS_QUERY,
    PackedGrid,
    pack_content,
    packed_client_app,
    tasks_of_node,
    unpack_content,
)


@pytest.fixture(autouse=True)
def _quiet_flower():
    logging.getLogger("flwr").setLevel(logging.WARNING)


def _run(values: dict, nodes: int | None = None, count: list | None = None,
         stacked: set | None = None) -> dict:
    cfg = RunConfig.from_mapping(values)
    m = cfg.num_tasks
    box: dict = {}
    client = make_client_app(cfg)
    if count is not None:
        def counted(message, context):
            count.append(message.metadata.message_type)
            if stacked is not None and "stack" in message.content:
                stacked.add(message.metadata.message_type)
            return client(message, context)
        app = counted
    else:
        app = client
    run_inprocess(make_server_app(cfg, on_done=box.update), app,
                  nodes or math.ceil(m / cfg.tasks_per_node))
    return box


def _untimed(record: dict) -> dict:
    """The record without measured durations (keys ending in ``_s``)."""
    return {k: v for k, v in record.items() if not k.endswith("_s")}


def _without_timing(records: list[dict]) -> list[dict]:
    return [_untimed(r) for r in records]


@pytest.mark.parametrize("values", [
    {"strategy": "mocha", "num-tasks": 100, "dim": 8, "samples-per-task": 20,
     "num-server-rounds": 4, "mocha.omega-every": 2},
    {"strategy": "fedem", "dataset": "synthetic", "num-tasks": 12, "dim": 5,
     "samples-per-task": 30, "num-server-rounds": 2, "fedem.M": 2},
    {"strategy": "fsvrg", "dataset": "sparse-federated", "num-tasks": 12, "dim": 300,
     "num-server-rounds": 2},
], ids=["mocha", "fedem", "fsvrg"])
def test_results_do_not_depend_on_tasks_per_node(values):
    m = values["num-tasks"]
    one = _run({**values, "tasks-per-node": 1})
    packed_k = 50 if m >= 100 else 5
    packed = _run({**values, "tasks-per-node": packed_k})
    assert _without_timing(one["rounds"]) == _without_timing(packed["rounds"])
    assert _untimed(one["final"]) == _untimed(packed["final"])
    assert one["final"].get("complete", True) is True


def test_one_message_per_node_and_round():
    values = {"strategy": "mocha", "num-tasks": 100, "dim": 8, "samples-per-task": 20,
              "num-server-rounds": 3, "eval-every": 1}
    unpacked, packed = [], []
    _run({**values, "tasks-per-node": 1}, count=unpacked)
    _run({**values, "tasks-per-node": 50}, count=packed)
    assert unpacked.count("train") == 300
    assert packed.count("train") == 2 * 3  # 2 nodes, 3 rounds
    assert packed.count("query.whoami") == 2 and packed.count(SLOTS_QUERY) == 2
    assert packed.count("evaluate") == unpacked.count("evaluate") // 50


def test_the_flwr_run_apps_pack_from_the_run_config(tmp_path):
    out = tmp_path / "res.json"
    base = {"num-tasks": 9, "dim": 4, "samples-per-task": 20, "num-server-rounds": 3}
    run_inprocess(flwr_run_server_app, flwr_run_client_app, 9,
                  run_config={**base, "results-file": str(out)})
    one = out.read_text()
    run_inprocess(flwr_run_server_app, flwr_run_client_app, 3,
                  run_config={**base, "tasks-per-node": 4, "results-file": str(out)})
    import json

    a, b = json.loads(one), json.loads(out.read_text())
    assert _without_timing(a["rounds"]) == _without_timing(b["rounds"])
    assert b["final"]["num_replies"] == 9


def test_tasks_of_node():
    assert tasks_of_node({"partition-id": 0}, 4, 10) == [0, 1, 2, 3]
    assert tasks_of_node({"partition-id": 2}, 4, 10) == [8, 9]
    assert tasks_of_node({"task-ids": "3, 5,4", "partition-id": 0}, 4, 10) == [3, 5, 4]
    for bad in ("a,b", "1,1", "-1", ""):
        with pytest.raises(ValueError, match="task-ids"):
            tasks_of_node({"task-ids": bad}, 2, 10)
    with pytest.raises(ValueError, match="no task ids"):
        tasks_of_node({}, 2, 10)


def test_pack_and_unpack_are_inverse_and_refuse_strangers():
    parts = {0: RecordDict({"config": ConfigRecord({"a": 1})}),
             3: RecordDict({"metrics": MetricRecord({"x": 2.0}), "config": ConfigRecord({})})}
    back = unpack_content(pack_content(parts))
    assert sorted(back) == [0, 3]
    assert back[3]["metrics"]["x"] == 2.0 and back[0]["config"]["a"] == 1
    with pytest.raises(ValueError, match="not a packed message"):
        unpack_content(RecordDict({"config": ConfigRecord({})}))
    bad = pack_content(parts)
    bad["9/config"] = ConfigRecord({})
    with pytest.raises(ValueError, match="names no slot"):
        unpack_content(bad)
    bad = pack_content(parts)
    bad["packing"] = ConfigRecord({"slots": ["x"]})
    with pytest.raises(ValueError, match="slots"):
        unpack_content(bad)


def _counter_app(fail_task: int | None = None):
    """A ClientApp-like callable: counts calls in context.state, raises for one task."""

    def app(message: Message, context: Context) -> Message:
        task = int(context.node_config["task-id"])
        if task == fail_task:
            raise RuntimeError(f"boom on task {task}")
        calls = context.state["c"]["calls"] + 1 if "c" in context.state else 1
        context.state["c"] = ConfigRecord({"calls": calls})
        return Message(RecordDict({"metrics": MetricRecord({"task": task, "calls": calls})}),
                       reply_to=message)

    return app


def _packed_grid(num_nodes: int, per_node: int, fail_task: int | None = None):
    client = packed_client_app(_counter_app(fail_task),
                               lambda ctx: tasks_of_node(ctx.node_config, per_node, 10))
    inner = InProcessGrid(client, num_nodes)
    return inner, PackedGrid(inner, query_timeout=5.0)


def _ask(grid: PackedGrid, nodes) -> dict[int, Message]:
    msgs = [Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=n,
                    message_type="train") for n in nodes]
    return {r.metadata.src_node_id: r for r in grid.send_and_receive(msgs, timeout=10.0)}


def test_slots_keep_their_own_state_and_one_failing_slot_fails_alone():
    inner, grid = _packed_grid(3, 4, fail_task=5)
    virtual = list(grid.get_node_ids())
    assert len(virtual) == 10  # 4 + 4 + 2 tasks
    for expected_calls in (1, 2):
        replies = _ask(grid, virtual)
        assert sorted(replies) == virtual
        for v, reply in replies.items():
            task = virtual.index(v)
            if task == 5:
                assert reply.has_error() and "boom on task 5" in reply.error.reason
            else:
                assert reply.content["metrics"]["task"] == task
                assert reply.content["metrics"]["calls"] == expected_calls
    assert grid.messages_sent == 3 + 2 * 3  # slots queries, then one message per node


def test_a_node_that_leaves_takes_its_tasks_and_comes_back_with_new_ids():
    inner, grid = _packed_grid(3, 4)
    first = list(grid.get_node_ids())
    inner.offline.add(1002)
    assert list(grid.get_node_ids()) == first[:4] + first[8:]
    inner.offline.clear()
    again = list(grid.get_node_ids())
    fresh = [v for v in again if v not in first]
    assert set(again) - set(fresh) == set(first[:4] + first[8:])
    assert len(again) == 10 and len(fresh) == 4  # the returning node's slots: new ids
    replies = _ask(grid, again)
    assert len(replies) == 10 and not any(r.has_error() for r in replies.values())


def test_a_node_with_a_bad_slots_reply_is_logged_and_left_out(caplog):
    def bad(message, context):
        if message.metadata.message_type == SLOTS_QUERY:
            return Message(RecordDict({"slots": ConfigRecord({"count": -1})}),
                           reply_to=message)
        raise AssertionError("never asked anything else")

    grid = PackedGrid(InProcessGrid(bad, 2), query_timeout=5.0)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert list(grid.get_node_ids()) == []
    assert "bad slots reply" in caplog.text
    # unknown virtual nodes are dropped with a warning, not sent
    assert list(grid.send_and_receive([Message(RecordDict(), dst_node_id=7,
                                               message_type="train")])) == []


def test_a_missing_slot_in_a_packed_reply_is_a_missing_reply():
    def drops_slot_1(message, context):
        if message.metadata.message_type == SLOTS_QUERY:
            return Message(RecordDict({"slots": ConfigRecord({"count": 2})}),
                           reply_to=message)
        parts = unpack_content(message.content)
        return Message(pack_content({0: parts[0]}), reply_to=message)

    grid = PackedGrid(InProcessGrid(drops_slot_1, 1), query_timeout=5.0)
    virtual = list(grid.get_node_ids())
    replies = _ask(grid, virtual)
    assert list(replies) == [virtual[0]]


def test_a_second_message_to_one_task_in_one_call_is_dropped_with_a_warning(caplog):
    inner, grid = _packed_grid(1, 2)
    virtual = list(grid.get_node_ids())
    with caplog.at_level(logging.WARNING, logger="flwr"):
        replies = _ask(grid, [virtual[0], virtual[0], virtual[1]])
    assert sorted(replies) == virtual and "a second train message" in caplog.text
    assert replies[virtual[0]].content["metrics"]["calls"] == 1


# ------------------------------------------------------------------ stacked messages (MOCHA)
STACKED_BASE = {"num-tasks": 12, "dim": 6, "samples-per-task": 15, "num-server-rounds": 4,
                "mocha.omega-every": 2, "mocha.drop-prob": 0.2, "mocha.sys-het": "high"}


@pytest.mark.parametrize("strategy", ["mocha", "cocoa", "mb-sdca", "mb-sgd"])
def test_stacked_runs_equal_unpacked_runs_bit_for_bit(strategy, tmp_path):
    values = {**STACKED_BASE, "strategy": strategy}
    one = _run({**values, "tasks-per-node": 1})
    seen: list = []
    stacked: set = set()
    packed = _run({**values, "tasks-per-node": 5}, count=seen, stacked=stacked)
    assert _without_timing(one["rounds"]) == _without_timing(packed["rounds"])
    assert _untimed(one["final"]) == _untimed(packed["final"])
    assert seen.count("train") == 3 * 4  # 3 nodes (5 + 5 + 2 tasks), 4 rounds
    assert stacked == {"train", "evaluate"}  # train and evaluate went stacked


def test_stacked_messages_one_per_node_and_round_and_the_flwr_run_app_stacks_too(tmp_path):
    stacked: list = []

    def spy(app):
        def call(message, context):
            if message.metadata.message_type in ("train", "evaluate"):
                stacked.append(("stack" in message.content,
                                len(message.content["arrays"]["task-id"].shape and
                                    message.content["arrays"]["w"].shape)))
            return app(message, context)
        return call

    out = tmp_path / "res.json"
    run_config = {**STACKED_BASE, "tasks-per-node": 4, "results-file": str(out)}
    run_inprocess(flwr_run_server_app, spy(flwr_run_client_app), 3, run_config=run_config)
    assert len(stacked) == 3 * (4 + 1)  # 3 nodes, 4 train rounds + the final evaluate
    assert all(is_stacked for is_stacked, _ in stacked)
    import json

    packed = json.loads(out.read_text())
    one = _run({**STACKED_BASE, "strategy": "mocha", "tasks-per-node": 1})
    assert _without_timing(packed["rounds"]) == _without_timing(one["rounds"])


def _mocha_node(tasks_per_node: int, num_tasks: int):
    """A stacked MOCHA client app over the synthetic data, its data, and a grid to it."""
    from fmtl_flower.apps.common import dataset_for

    cfg = RunConfig.from_mapping({**STACKED_BASE, "tasks-per-node": tasks_per_node,
                                  "num-tasks": num_tasks})
    return cfg, dataset_for(cfg), make_client_app(cfg)


def _stacked_train(data, tasks, slots, *, w=None, task_ids=None, server_round=1,
                   last_accepted=0):
    import numpy as np
    from flwr.app import ArrayRecord

    from fmtl_flower.wire import to_array

    k = len(tasks)
    w = np.zeros((k, data.dim)) if w is None else w
    arrays = {"w": to_array(w),
              "task-id": to_array(np.array(task_ids or tasks, dtype=np.int64)),
              "last-accepted-round": to_array(np.full(k, last_accepted, dtype=np.int64)),
              "m-tt": to_array(np.full(k, 2.0)), "sigma-prime": to_array(np.full(k, 1.5)),
              "budget": to_array(np.full(k, 7, dtype=np.int64)),
              "dropped": to_array(np.zeros(k, dtype=bool))}
    config = {"server-round": server_round, "seed": 3, "eval": True}
    return Message(RecordDict({"stack": ConfigRecord({"protocol": "mocha", "slots": slots}),
                               "config": ConfigRecord(config),
                               "arrays": ArrayRecord(arrays)}),
                   dst_node_id=1001, message_type="train"), config


def _one_task_train(data, task, config, w):
    from flwr.app import ArrayRecord

    from fmtl_flower.wire import to_array

    one = {"task-id": task, "last-accepted-round": 0, "m-tt": 2.0, "sigma-prime": 1.5,
           "budget": 7, "dropped": False, **config}
    return Message(RecordDict({"config": ConfigRecord(one),
                               "arrays": ArrayRecord({"w": to_array(w)})}),
                   dst_node_id=1001, message_type="train")


def test_a_stacked_reply_holds_the_unpacked_replies_records_and_a_bad_slot_fails_alone():
    import numpy as np

    from fmtl_flower.wire import from_array

    _, data, packed_app = _mocha_node(4, 8)
    _, _, one_app = _mocha_node(1, 8)
    rng = np.random.default_rng(0)
    w = rng.normal(size=(4, data.dim))
    w[2, 0] = np.nan  # slot 2's model is malformed
    tasks = [4, 5, 6, 7]
    msg, config = _stacked_train(data, tasks, [0, 1, 2, 3], w=w,
                                 task_ids=[4, 5, 6, 99][:3] + [7])
    ctx = Context(run_id=1, node_id=1001, node_config={"partition-id": 1},
                  state=RecordDict(), run_config={})
    reply = packed_app(msg, ctx)
    assert reply.content["stack"]["slots"] == [0, 1, 3]
    assert reply.content["stack-errors"]["slots"] == [2]
    assert "'w' must be finite" in reply.content["stack-errors"]["reasons"][0]
    arrays = reply.content["arrays"]
    for row, (slot, task) in enumerate([(0, 4), (1, 5), (3, 7)]):
        one_ctx = Context(run_id=1, node_id=2000 + task, node_config={"partition-id": task},
                          state=RecordDict(), run_config={})
        one = one_app(_one_task_train(data, task, config, w[slot]), one_ctx)
        metrics = one.content["metrics"]
        for key, value in metrics.items():
            assert from_array(arrays[key])[row].item() == value, key
        np.testing.assert_array_equal(from_array(arrays["delta-b"])[row],
                                      from_array(one.content["arrays"]["delta-b"]))
    # the failed slot kept no state (round 1 accepted: it restarts, the others commit);
    # a wrong task id fails its slot only, too
    msg, _ = _stacked_train(data, tasks, [0, 1, 2, 3], w=np.zeros((4, data.dim)),
                            task_ids=[4, 5, 6, 3], server_round=2, last_accepted=1)
    reply = packed_app(msg, ctx)
    assert reply.content["stack"]["slots"] == [0, 1, 2]
    assert "task 3 reached the slot of task 7" in reply.content["stack-errors"]["reasons"][0]
    assert from_array(reply.content["arrays"]["state-ok"]).tolist() == [1, 1, 0]


@pytest.mark.parametrize("strategy, vector", [("mocha", "delta-b"), ("mb-sgd", "grad")])
def test_a_malformed_slot_of_a_stacked_reply_rejects_only_its_task(strategy, vector, caplog):
    import numpy as np
    from flwr.app import ArrayRecord

    from fmtl_flower.wire import from_array, to_array

    cfg = RunConfig.from_mapping({**STACKED_BASE, "strategy": strategy, "mocha.drop-prob": 0.0,
                                  "tasks-per-node": 4, "num-server-rounds": 3})
    client = make_client_app(cfg)

    def corrupt(message, context):
        reply = client(message, context)
        if "stack" in message.content and message.metadata.message_type == "train":
            arrays = reply.content["arrays"]
            delta = np.array(from_array(arrays[vector]))
            tasks = from_array(arrays["task-id"]).tolist()
            if 6 in tasks:
                delta[tasks.index(6), 0] = np.inf  # task 6's row is malformed
                arrays[vector] = to_array(delta)
            if 9 in tasks:  # task 9's slot claims another task
                ids = np.array(from_array(arrays["task-id"]))
                ids[tasks.index(9)] = 10
                reply.content["arrays"] = ArrayRecord({**dict(arrays.items()),
                                                       "task-id": to_array(ids)})
        return reply

    box: dict = {}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        grid = run_inprocess(make_server_app(cfg, on_done=box.update), corrupt, 3)
    assert "reply of task 6 (node" in caplog.text and "non-finite" in caplog.text
    assert "reply of task 9 (node" in caplog.text
    # the train replies of rounds 1..3 complete records 0..2: tasks 6 and 9 rejected, the
    # other 10 accepted; the final evaluate round (not corrupted) completes record 3
    assert [r["tasks_missing"] for r in box["rounds"]] == [[6, 9], [6, 9], [6, 9], []]
    assert [r["num_replies"] for r in box["rounds"][1:]] == [10, 10, 10]
    assert grid.contexts  # three nodes served every task


def test_automatic_packing_rule():
    from fmtl_flower.packing import auto_tasks_per_node

    assert auto_tasks_per_node("mocha", 29, "inprocess")[0] == 29
    assert auto_tasks_per_node("cocoa", 100_000, "inprocess")[0] == 1000
    assert auto_tasks_per_node("mb-sdca", 10_000, "ray", cores=2)[0] == 1000
    assert auto_tasks_per_node("mocha", 30, "ray", cores=4)[0] == 8
    assert auto_tasks_per_node("mb-sgd", 100, "inprocess")[0] == 100
    for strategy in ("fedem", "fedavg", "fedprox", "fedavg-ft", "clustered", "local"):
        assert auto_tasks_per_node(strategy, 100, "inprocess")[0] == 100  # FedEM's stack
    for strategy in ("fsvrg", "fsvrg-naive", "gd", "cocoa-plus", "dane"):  # FSVRG's stack
        assert auto_tasks_per_node(strategy, 100, "inprocess")[0] == 100
        assert auto_tasks_per_node(strategy, 100, "ray", cores=2)[0] == 50
    assert auto_tasks_per_node("ofmtl", 100, "inprocess")[0] == 1
    k, rule = auto_tasks_per_node("mocha", 2500, "inprocess")
    assert k == 1000 and rule.startswith("2500 tasks on 3 nodes, 1000 per node (automatic")


def test_fmtl_run_packs_automatically_says_so_and_gets_the_same_results(tmp_path, capsys):
    import json

    from fmtl_flower.cli import main

    args = ["run", "mocha", "--dataset", "synthetic", "--rounds", "3", "--set", "num-tasks=7",
            "--set", "dim=4", "--set", "samples-per-task=10"]
    assert main([*args, "--out", str(tmp_path / "auto.json")]) == 0
    header = capsys.readouterr().out
    assert "task packing: 7 tasks on 1 node, 7 per node (automatic" in header
    assert main([*args, "--set", "tasks-per-node=1", "--out", str(tmp_path / "one.json")]) == 0
    assert "task packing" not in capsys.readouterr().out
    auto, one = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("auto", "one"))
    assert auto["config"]["tasks-per-node"] == 7 and one["config"]["tasks-per-node"] == 1
    assert _without_timing(auto["rounds"]) == _without_timing(one["rounds"])


_LOADS: list[int] = []


def _counting_loader(context):
    import numpy as np

    task = int(context.node_config["task-id"])
    _LOADS.append(task)
    rng = np.random.default_rng(task)
    X = rng.normal(size=(10, 3))
    return X, np.where(X[:, 0] > 0, 1.0, -1.0)


def test_copies_of_a_stacked_handler_share_the_tasks_loaded_in_the_process():
    """Flower's Ray engine ships a fresh copy of the ClientApp with every message: the
    tasks must not be loaded again for every copy."""
    import pickle

    import numpy as np
    from flwr.app import ArrayRecord

    from fmtl_flower.clients.mocha import MOCHAClient
    from fmtl_flower.clients.packed_mocha import PackedMOCHA
    from fmtl_flower.wire import to_array

    InProcessGrid(_counter_app(), 1)  # sets Flower's TaskIdentity (messages need it)
    handler = PackedMOCHA(MOCHAClient(_counting_loader))
    ctx = Context(run_id=7, node_id=1001, node_config={"partition-id": 0}, state=RecordDict(),
                  run_config={})
    _LOADS.clear()
    for server_round in (1, 2, 3):
        copy = pickle.loads(pickle.dumps(handler))
        k = 2
        arrays = {"w": to_array(np.zeros((k, 3))),
                  "task-id": to_array(np.array([4, 5], dtype=np.int64)),
                  "last-accepted-round": to_array(np.full(k, server_round - 1,
                                                          dtype=np.int64)),
                  "m-tt": to_array(np.ones(k)), "sigma-prime": to_array(np.ones(k)),
                  "budget": to_array(np.full(k, 5, dtype=np.int64)),
                  "dropped": to_array(np.zeros(k, dtype=bool))}
        msg = Message(RecordDict({"config": ConfigRecord({"server-round": server_round,
                                                          "seed": 0, "eval": False}),
                                  "arrays": ArrayRecord(arrays)}),
                      dst_node_id=1001, message_type="train")
        _, done, errors = copy(msg, ctx, [(0, 4), (1, 5)])
        assert done == [0, 1] and not errors
    assert sorted(_LOADS) == [4, 5]


def test_the_reply_boundary_reads_a_stacked_reply_row_by_row_once(caplog):
    from fmtl_flower.packing import StackGroup
    from fmtl_flower.strategies.trust import ReplyBoundary

    InProcessGrid(_counter_app(), 1)  # sets Flower's TaskIdentity (messages need it)
    boundary = ReplyBoundary("TEST")
    boundary.begin()
    group = StackGroup(node=1001, slots=[0, 1, 2], tasks=[4, 5, 6], virtual=[11, 12, 13])
    sent = Message(RecordDict({"stack": ConfigRecord({"protocol": "p", "slots": [0, 1, 2]})}),
                   dst_node_id=1001, message_type="train")
    sent.metadata.__dict__["_message_id"] = "m1"
    boundary.track_stack(group, sent)

    def parse_stack(reply, g):
        assert g is group
        return {4: {"v": 1}, 6: {"v": 3}}, {5: "row 5 is bad"}

    reply = Message(RecordDict({"x": ConfigRecord({})}), reply_to=sent)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        out = boundary.read("round 1", [reply, reply], lambda r, t: {}, None, parse_stack)
    assert out.accepted == {4: {"v": 1}, 6: {"v": 3}} and out.failed == {5: "row 5 is bad"}
    assert "reply of task 5 (node 1001) rejected: row 5 is bad" in caplog.text
    assert "second reply for tasks [4, 5, 6]" in caplog.text  # one reply per task and round
    assert boundary.sent == {11: 4, 12: 5, 13: 6}

    def broken(reply, g):
        raise KeyError("hostile payload")

    out = boundary.read("round 1", [reply], lambda r, t: {}, None, broken)
    assert out.accepted == {} and set(out.failed) == {4, 5, 6}


def _changed_loader(context):
    X, y = _counting_loader(context)
    if int(context.node_config["task-id"]) == 5:
        X = X + 1.0  # task 5's device now holds other data of the same size
    return X, y


def test_a_stacked_slot_whose_data_changed_restarts_alone():
    import numpy as np
    from flwr.app import ArrayRecord

    from fmtl_flower.clients.mocha import MOCHAClient
    from fmtl_flower.clients.packed_mocha import PackedMOCHA
    from fmtl_flower.wire import from_array, to_array

    InProcessGrid(_counter_app(), 1)  # sets Flower's TaskIdentity (messages need it)
    ctx = Context(run_id=8, node_id=1001, node_config={"partition-id": 0}, state=RecordDict(),
                  run_config={})

    def train(handler, server_round):
        arrays = {"w": to_array(np.zeros((2, 3))),
                  "task-id": to_array(np.array([4, 5], dtype=np.int64)),
                  "last-accepted-round": to_array(np.full(2, server_round - 1,
                                                          dtype=np.int64)),
                  "m-tt": to_array(np.ones(2)), "sigma-prime": to_array(np.ones(2)),
                  "budget": to_array(np.full(2, 5, dtype=np.int64)),
                  "dropped": to_array(np.zeros(2, dtype=bool))}
        msg = Message(RecordDict({"config": ConfigRecord({"server-round": server_round,
                                                          "seed": 0, "eval": False}),
                                  "arrays": ArrayRecord(arrays)}),
                      dst_node_id=1001, message_type="train")
        content, done, _ = handler(msg, ctx, [(0, 4), (1, 5)])
        assert done == [0, 1]
        return from_array(content["arrays"]["state-ok"]).tolist()

    assert train(PackedMOCHA(MOCHAClient(_counting_loader)), 1) == [1, 1]
    assert train(PackedMOCHA(MOCHAClient(_counting_loader)), 2) == [1, 1]  # state resumed
    assert train(PackedMOCHA(MOCHAClient(_changed_loader)), 3) == [1, 0]  # task 5 restarts


def test_a_stacked_mbsgd_reply_holds_the_unpacked_replies_records():
    import numpy as np
    from flwr.app import ArrayRecord

    from fmtl_flower.wire import from_array, to_array

    def app(tasks_per_node):
        cfg = RunConfig.from_mapping({**STACKED_BASE, "strategy": "mb-sgd", "num-tasks": 8,
                                      "tasks-per-node": tasks_per_node})
        return make_client_app(cfg)

    InProcessGrid(_counter_app(), 1)  # sets Flower's TaskIdentity (messages need it)
    packed_app, one_app = app(4), app(1)
    rng = np.random.default_rng(1)
    w = rng.normal(size=(4, STACKED_BASE["dim"]))
    config = {"server-round": 2, "seed": 5, "eval": True}
    arrays = {"w": to_array(w), "task-id": to_array(np.array([4, 5, 6, 7], dtype=np.int64)),
              "budget": to_array(np.array([3, 0, 5, 99], dtype=np.int64)),  # 99 > n: bad
              "dropped": to_array(np.array([False, False, True, False]))}
    msg = Message(RecordDict({"stack": ConfigRecord({"protocol": "mb-sgd",
                                                     "slots": [0, 1, 2, 3]}),
                              "config": ConfigRecord(config), "arrays": ArrayRecord(arrays)}),
                  dst_node_id=1001, message_type="train")
    ctx = Context(run_id=3, node_id=1001, node_config={"partition-id": 1}, state=RecordDict(),
                  run_config={})
    reply = packed_app(msg, ctx)
    assert reply.content["stack"]["slots"] == [0, 1, 2]
    assert reply.content["stack-errors"]["slots"] == [3]
    assert "budget must be in 0..n-train" in reply.content["stack-errors"]["reasons"][0]
    rows = reply.content["arrays"]
    for row, task in enumerate([4, 5, 6]):
        one = {"task-id": task, "budget": [3, 0, 5][row], "dropped": row == 2, **config}
        sent = Message(RecordDict({"config": ConfigRecord(one),
                                   "arrays": ArrayRecord({"w": to_array(w[row])})}),
                       dst_node_id=1001, message_type="train")
        one_ctx = Context(run_id=3, node_id=3000 + task, node_config={"partition-id": task},
                          state=RecordDict(), run_config={})
        got = one_app(sent, one_ctx)
        for key, value in got.content["metrics"].items():
            assert from_array(rows[key])[row].item() == value, key
        np.testing.assert_array_equal(from_array(rows["grad"])[row],
                                      from_array(got.content["arrays"]["grad"]))
