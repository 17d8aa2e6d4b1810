"""FedEM's stacked messages (strategies/packed_fedem.py, clients/packed_fedem.py): one message
per packed node and round, results bit for bit those of one task per node, and a malformed
slot or row failing only its task."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fmtl_flower.apps.common import dataset_for, make_client_app, make_server_app
from fmtl_flower.checkpoint import read_state_file
from fmtl_flower.clients.packed_fedem import STATE, PackedFedEM, StackedGenerations
from fmtl_flower.config import RunConfig
from fmtl_flower.engine import run_inprocess
from fmtl_flower.wire import from_array, to_array

BASE = {"dataset": "synthetic", "num-tasks": 10, "dim": 5, "samples-per-task": 30,
        "num-server-rounds": 3, "fedem.M": 2, "fedem.train-tasks-frac": 0.8,
        "fedem.fraction": 0.7, "fedem.local-epochs": 1, "fedem.batch-size": 8, "eval-every": 2,
        "model": "logistic"}
METHODS = ["fedem", "fedavg", "fedprox", "fedavg-ft", "clustered", "local", "cfl", "pfedme"]
#: CFL with thresholds that split every cluster of more than two clients each round, so the
#: tasks of one node receive different cluster models.
EXTRA = {"cfl": {"fedem.cfl-eps1": 1e6, "fedem.cfl-eps2": 0.0}}


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


@pytest.mark.parametrize("method", METHODS)
def test_stacked_fedem_runs_equal_unpacked_runs_bit_for_bit(method):
    values = {**BASE, "strategy": method, **EXTRA.get(method, {})}
    one = _run({**values, "tasks-per-node": 1})
    seen: list = []
    packed = _run({**values, "tasks-per-node": 4}, seen)
    assert [_untimed(r) for r in one["rounds"]] == [_untimed(r) for r in packed["rounds"]]
    assert _untimed(one["final"]) == _untimed(packed["final"])
    assert one["final"]["num_replies"] > 0
    # one message per node and round (3 nodes: 4 + 4 + 2 tasks), every one stacked
    trains = [stacked for kind, stacked in seen if kind == "train"]
    evaluates = [stacked for kind, stacked in seen if kind == "evaluate"]
    assert all(trains) and all(evaluates)
    assert len(evaluates) == 3 * 2  # rounds 2 and 3 evaluate (eval-every 2, the last)
    assert 3 <= len(trains) <= 3 * 3  # sampled tasks only: a node with none gets none


def test_stacked_device_state_files_equal_the_unpacked_ones(tmp_path):
    values = {**BASE, "strategy": "local", "fedem.fraction": 1.0, "fedem.train-tasks-frac": 1.0}
    _run({**values, "tasks-per-node": 1, "client-state-dir": str(tmp_path / "one")})
    _run({**values, "tasks-per-node": 5, "client-state-dir": str(tmp_path / "packed")})
    files = sorted(p.name for p in (tmp_path / "one").glob("fedem-task-*"))
    assert len(files) == 10
    for name in files:
        a_arrays, a_meta = read_state_file(tmp_path / "one" / name)
        b_arrays, b_meta = read_state_file(tmp_path / "packed" / name)
        assert a_meta == b_meta and sorted(a_arrays) == sorted(b_arrays)
        assert {"latest.own", "previous.own"} <= set(a_arrays)
        for key in a_arrays:
            np.testing.assert_array_equal(a_arrays[key], b_arrays[key])


def test_a_packed_run_resumes_from_the_state_files_as_an_unpacked_one(tmp_path):
    """A new Flower run (empty node state) reads each slot's state file: the resumed
    packed run matches the resumed unpacked run."""
    values = {**BASE, "strategy": "fedem", "fedem.fraction": 1.0, "fedem.train-tasks-frac": 1.0}
    results = []
    for k, name in ((1, "one"), (5, "packed")):
        run = {**values, "tasks-per-node": k, "client-state-dir": str(tmp_path / name)}
        _run(run)
        results.append(_run(run))  # the devices start from the first run's state files
    assert [_untimed(r) for r in results[0]["rounds"]] == \
        [_untimed(r) for r in results[1]["rounds"]]


def _node(method: str = "fedem"):
    cfg = RunConfig.from_mapping({**BASE, "strategy": method, "tasks-per-node": 4})
    return cfg, dataset_for(cfg), make_client_app(cfg)


def _config(method: str = "fedem", server_round: int = 1) -> dict:
    return {"server-round": server_round, "seed": 3, "method": method, "model": "logistic",
            "num-classes": 2, "hidden": 32, "batch-size": 8, "local-epochs": 1,
            "lr": 0.05, "momentum": 0.9, "weight-decay": 5e-4, "prox-mu": 0.0,
            "pi-floor": 1e-6, "finetune-epochs": 1}


def _stacked(components, task_ids, slots, config, kind="train"):
    k = len(slots)
    arrays = {"components-0": to_array(components),
              "components-of": to_array(np.zeros(k, dtype=np.int64)),
              "task-id": to_array(np.array(task_ids, dtype=np.int64)),
              "unseen": to_array(np.zeros(k, dtype=bool))}
    return Message(RecordDict({"stack": ConfigRecord({"protocol": "fedem", "slots": slots}),
                               "config": ConfigRecord(config),
                               "arrays": ArrayRecord(arrays)}),
                   dst_node_id=1001, message_type=kind)


def _one(components, task, config, kind="train"):
    return Message(RecordDict({"config": ConfigRecord({**config, "task-id": task,
                                                       "unseen": False}),
                               "arrays": ArrayRecord({"components": to_array(components)})}),
                   dst_node_id=1001, message_type=kind)


def test_a_stacked_reply_holds_the_unpacked_replies_and_a_bad_slot_fails_alone():
    _, data, packed_app = _node()
    _, _, one_app = _node()
    components = np.random.default_rng(0).normal(size=(2, data.dim + 1)) * 0.1
    ctx = Context(run_id=1, node_id=1001, node_config={"partition-id": 1},
                  state=RecordDict(), run_config={})
    one_ctx = {t: Context(run_id=1, node_id=2000 + t, node_config={"partition-id": t},
                          state=RecordDict(), run_config={}) for t in (4, 5, 7)}
    for rnd in (1, 2, 3):  # the state is carried: rounds 2 and 3 start from it
        config = _config(server_round=rnd)
        # slot 2 (task 6) gets a message for task 99: that slot alone fails
        reply = packed_app(_stacked(components, [4, 5, 99, 7], [0, 1, 2, 3], config), ctx)
        assert reply.content["stack"]["slots"] == [0, 1, 3]
        assert reply.content["stack-errors"]["slots"] == [2]
        assert "task 99 reached task 6" in reply.content["stack-errors"]["reasons"][0]
        arrays = reply.content["arrays"]
        for row, task in enumerate([4, 5, 7]):
            one = one_app(_one(components, task, config), one_ctx[task])
            for key, value in one.content["metrics"].items():
                if not key.endswith("-s"):
                    assert from_array(arrays[key])[row].item() == value, key
            for key in ("components", "weights"):
                np.testing.assert_array_equal(from_array(arrays[key])[row],
                                              from_array(one.content["arrays"][key]))
    assert STATE in ctx.state and "fedem.arrays" not in ctx.state  # one stacked record
    stored = StackedGenerations(ctx.state[STATE])
    assert sorted(stored.slots) == [0, 1, 3]
    assert [stored.slots[0][g][1]["round"] for g in ("latest", "previous")] == [3, 2]
    # evaluate, stacked, equals the unpacked evaluate (state of round 3)
    config = _config(server_round=3)
    reply = packed_app(_stacked(components, [4, 5, 6, 7], [0, 1, 2, 3], config, "evaluate"),
                       ctx)
    assert reply.content["stack"]["slots"] == [0, 1, 2, 3]
    one = one_app(_one(components, 7, config, "evaluate"), one_ctx[7])
    for key, value in one.content["metrics"].items():
        assert from_array(reply.content["arrays"][key])[3].item() == value, key


def test_a_malformed_stacked_message_fails_the_whole_message():
    _, data, packed_app = _node()
    msg = _stacked(np.zeros((2, data.dim + 1)), [0, 1], [0, 1], _config())
    del msg.content["arrays"]["unseen"]
    ctx = Context(run_id=1, node_id=1001, node_config={"partition-id": 0},
                  state=RecordDict(), run_config={})
    with pytest.raises(ValueError, match="lacks array 'unseen'"):
        packed_app(msg, ctx)


def test_stacked_state_round_trips_and_a_broken_record_starts_afresh():
    state = StackedGenerations(None)
    state.slots = {3: {"latest": ({"pi": np.array([0.25, 0.75]),
                                   "momentum": np.arange(6.0).reshape(2, 3)},
                                  {"signature": "fedem|2|3", "round": 4}),
                       "previous": ({"pi": np.array([0.5, 0.5]),
                                     "momentum": np.zeros((2, 3))},
                                    {"signature": "fedem|2|3", "round": 2})},
                   0: {"latest": ({"pi": np.ones(1), "momentum": np.ones((1, 3)),
                                   "own": np.full((1, 3), 2.0)},
                                  {"signature": "local|1|3", "round": 1})}}
    back = StackedGenerations(state.record())
    assert sorted(back.slots) == [0, 3]
    for slot, generations in state.slots.items():
        assert list(back.slots[slot]) == list(generations)
        for g, (arrays, info) in generations.items():
            assert back.slots[slot][g][1] == info
            assert sorted(back.slots[slot][g][0]) == sorted(arrays)
            for key, value in arrays.items():
                np.testing.assert_array_equal(back.slots[slot][g][0][key], value)
    record = state.record()
    record["values"] = to_array(np.zeros(2))  # entries now point outside the values
    assert StackedGenerations(record).slots == {}


def test_a_malformed_row_of_a_stacked_fedem_reply_rejects_only_its_task(caplog):
    values = {**BASE, "strategy": "fedem", "fedem.fraction": 1.0, "fedem.train-tasks-frac": 1.0,
              "tasks-per-node": 4}

    def corrupt(client, message, context):
        reply = client(message, context)
        if "stack" in message.content and message.metadata.message_type == "train":
            arrays = reply.content["arrays"]
            tasks = from_array(arrays["task-id"]).tolist()
            if 6 in tasks:  # task 6's components are not finite
                theta = np.array(from_array(arrays["components"]))
                theta[tasks.index(6), 0, 0] = np.inf
                arrays["components"] = to_array(theta)
            if 1 in tasks:  # task 1's row claims another task
                ids = np.array(from_array(arrays["task-id"]))
                ids[tasks.index(1)] = 2
                arrays["task-id"] = to_array(ids)
            if 8 in tasks:  # task 8's loss is not finite
                loss = np.array(from_array(arrays["train-loss"]))
                loss[tasks.index(8)] = np.nan
                arrays["train-loss"] = to_array(loss)
        return reply

    with caplog.at_level(logging.WARNING, logger="flwr"):
        box = _run(values, app_wrap=corrupt)
    assert "reply of task 6 (node" in caplog.text and "non-finite" in caplog.text
    assert "reply of task 1 (node" in caplog.text and "reply of task 8 (node" in caplog.text
    assert [r["num_replies"] for r in box["rounds"]] == [7, 7, 7]
    # the same run where those three replies were lost gives the same components
    lost = _run(values, app_wrap=lambda c, m, x: _drop_rows(c(m, x), m, {1, 6, 8}))
    assert [_untimed(r) for r in lost["rounds"]] == [_untimed(r) for r in box["rounds"]]


def _drop_rows(reply, message, tasks):
    """The stacked reply without the rows of ``tasks`` (as if their slots failed)."""
    if "stack" not in message.content or message.metadata.message_type != "train":
        return reply
    arrays = reply.content["arrays"]
    ids = from_array(arrays["task-id"]).tolist()
    keep = [i for i, t in enumerate(ids) if t not in tasks]
    slots = reply.content["stack"]["slots"]
    failed = [s for i, s in enumerate(slots) if i not in keep]
    reply.content["stack"] = ConfigRecord({"protocol": "fedem",
                                           "slots": [slots[i] for i in keep]})
    reply.content["stack-errors"] = ConfigRecord({"slots": failed,
                                                  "reasons": ["lost"] * len(failed)})
    reply.content["arrays"] = ArrayRecord({k: to_array(from_array(v)[keep])
                                           for k, v in arrays.items()})
    return reply


def test_a_torch_client_is_refused_by_the_stacked_handler():
    from fmtl_flower.clients.fedem_torch import TorchFedEMClient

    with pytest.raises(ValueError, match="numpy models only"):
        PackedFedEM(TorchFedEMClient(lambda: None, lambda ctx: None))


def test_tasks_sent_other_components_get_their_own_set_in_one_message():
    """Tasks may be sent different components (one set per distinct encoding, each row
    naming its set): each slot trains on its own set, as in a one-task message."""
    _, data, packed_app = _node()
    _, _, one_app = _node()
    rng = np.random.default_rng(1)
    sets = [rng.normal(size=(2, data.dim + 1)) * 0.1, rng.normal(size=(2, data.dim + 1))]
    msg = _stacked(sets[0], [4, 5, 6, 7], [0, 1, 2, 3], _config())
    msg.content["arrays"]["components-1"] = to_array(sets[1])
    msg.content["arrays"]["components-of"] = to_array(np.array([0, 1, 1, 0]))
    ctx = Context(run_id=1, node_id=1001, node_config={"partition-id": 1},
                  state=RecordDict(), run_config={})
    reply = packed_app(msg, ctx)
    for row, (task, g) in enumerate([(4, 0), (5, 1), (6, 1), (7, 0)]):
        one = one_app(_one(sets[g], task, _config()),
                      Context(run_id=1, node_id=2000 + task, node_config={"partition-id": task},
                              state=RecordDict(), run_config={}))
        np.testing.assert_array_equal(from_array(reply.content["arrays"]["components"])[row],
                                      from_array(one.content["arrays"]["components"]))
    msg.content["arrays"]["components-of"] = to_array(np.array([0, 1, 2, 0]))
    with pytest.raises(ValueError, match="must index the 2 components sets"):
        packed_app(msg, ctx)


def _set_row(arrays, key, task, change):
    """``arrays[key]`` with the row of ``task`` changed by ``change(row) -> row``."""
    tasks = from_array(arrays["task-id"]).tolist()
    if task in tasks:
        values = np.array(from_array(arrays[key]))
        values[tasks.index(task)] = change(values[tasks.index(task)])
        arrays[key] = to_array(values)


ROW_CORRUPTIONS = {  # each makes task 5's row invalid and leaves the others valid
    "huge component": ("components", lambda r: r + 1e7),
    "far moved component": ("components", lambda r: r + 1e5),
    "nan weight": ("weights", lambda r: r * np.nan),
    "weight not 0 or n": ("weights", lambda r: r * 0.5),
    "no trained component": ("weights", lambda r: r * 0.0),
    "negative loss": ("train-loss", lambda r: -1.0),
    "loss above the bound": ("train-loss", lambda r: 1e7),
    "inf timing": ("e-step-s", lambda r: np.inf),
    "timing above the timeout": ("train-s", lambda r: 1e9),
    "wrong round": ("round", lambda r: r + 1),
    "wrong n-train": ("n-train", lambda r: r + 1),
}


@pytest.mark.parametrize("case", sorted(ROW_CORRUPTIONS))
def test_every_bad_row_of_a_stacked_fedem_reply_is_rejected_alone(case):
    """Whatever is wrong with one row, the run equals the run in which that task's
    replies were lost (its slot failed), and the other tasks of its node are accepted."""
    key, change = ROW_CORRUPTIONS[case]
    values = {**BASE, "strategy": "fedem", "fedem.fraction": 1.0, "fedem.train-tasks-frac": 1.0,
              "tasks-per-node": 4, "num-server-rounds": 2}

    def corrupt(client, message, context):
        reply = client(message, context)
        if "stack" in message.content and message.metadata.message_type == "train":
            _set_row(reply.content["arrays"], key, 5, change)
        return reply

    box = _run(values, app_wrap=corrupt)
    lost = _run(values, app_wrap=lambda c, m, x: _drop_rows(c(m, x), m, {5}))
    assert [r["num_replies"] for r in box["rounds"]] == [9, 9]
    assert [_untimed(r) for r in lost["rounds"]] == [_untimed(r) for r in box["rounds"]]


@pytest.mark.parametrize("case", ["float ids", "short column", "no arrays", "wrong protocol",
                                  "stranger slot"])
def test_a_malformed_stacked_fedem_reply_rejects_its_nodes_tasks_only(case):
    values = {**BASE, "strategy": "fedem", "fedem.fraction": 1.0, "fedem.train-tasks-frac": 1.0,
              "tasks-per-node": 4, "num-server-rounds": 2}

    def corrupt(client, message, context):
        reply = client(message, context)
        if ("stack" in message.content and message.metadata.message_type == "train"
                and 5 in from_array(message.content["arrays"]["task-id"]).tolist()):
            arrays = reply.content["arrays"]
            if case == "float ids":
                arrays["task-id"] = to_array(from_array(arrays["task-id"]).astype(float))
            elif case == "short column":
                arrays["train-loss"] = to_array(from_array(arrays["train-loss"])[:-1])
            elif case == "no arrays":
                del reply.content["arrays"]
            elif case == "wrong protocol":
                reply.content["stack"] = ConfigRecord({"protocol": "mocha",
                                                       "slots": [0, 1, 2, 3]})
            else:
                reply.content["stack"] = ConfigRecord({"protocol": "fedem",
                                                       "slots": [0, 1, 2, 9]})
        return reply

    box = _run(values, app_wrap=corrupt)
    lost = _run(values, app_wrap=lambda c, m, x: _drop_rows(c(m, x), m, {4, 5, 6, 7}))
    assert [r["num_replies"] for r in box["rounds"]] == [6, 6]  # node 1's four tasks lost
    assert [_untimed(r) for r in lost["rounds"]] == [_untimed(r) for r in box["rounds"]]


def test_fmtl_run_packs_fedem_automatically_and_says_so(tmp_path, capsys):
    import json

    from fmtl_flower.cli import main

    args = ["run", "fedavg", "--dataset", "synthetic", "--rounds", "2", "--set", "num-tasks=7",
            "--set", "dim=4", "--set", "samples-per-task=10"]
    assert main([*args, "--out", str(tmp_path / "auto.json")]) == 0
    assert "task packing: 7 tasks on 1 node, 7 per node (automatic" in capsys.readouterr().out
    assert main([*args, "--set", "tasks-per-node=1", "--out", str(tmp_path / "one.json")]) == 0
    auto, one = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("auto", "one"))
    assert auto["config"]["tasks-per-node"] == 7
    assert [_untimed(r) for r in auto["rounds"]] == [_untimed(r) for r in one["rounds"]]
