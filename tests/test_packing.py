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


def _run(values: dict, nodes: int | None = None, count: list | None = None) -> dict:
    cfg = RunConfig.from_mapping(values)
    m = cfg.num_tasks
    box: dict = {}
    client = make_client_app(cfg)
    if count is not None:
        def counted(message, context):
            count.append(message.metadata.message_type)
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
     "num-server-rounds": 4, "omega-every": 2},
    {"strategy": "fedem", "dataset": "synthetic", "num-tasks": 12, "dim": 5,
     "samples-per-task": 30, "num-server-rounds": 2, "M": 2},
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
