"""Fast Array encoding: byte-identical to Flower's, and safe on foreign headers."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fmtl_flower import wire
from fmtl_flower.wire import (
    array_record,
    config_record,
    from_array,
    metric_record,
    record_dict,
    refill_arrays,
    refill_config,
    to_array,
)


@pytest.mark.parametrize("values", [
    np.arange(5.0), np.random.default_rng(0).normal(size=(3, 4)), np.zeros((0, 3)),
    np.arange(6, dtype=np.int64), np.float32([1, 2]), np.array(3.0), np.ones((2, 3))[:, ::2]])
def test_same_bytes_as_flower_and_round_trip(values):
    ours = to_array(values)
    assert ours.data == Array(np.ascontiguousarray(values) if values.ndim else values).data
    for array in (ours, Array(values)):
        decoded = from_array(array)
        assert decoded.dtype == values.dtype and decoded.shape == values.shape
        np.testing.assert_array_equal(decoded, values)
        np.testing.assert_array_equal(array.numpy(), values)


def test_fortran_order_and_bad_stype_fall_back_or_fail():
    values = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(from_array(Array(values)), values)
    bad = Array(dtype="float64", shape=(1,), stype="torch.Tensor", data=b"x")
    with pytest.raises(TypeError, match="serialisation"):
        from_array(bad)
    with pytest.raises(TypeError):
        to_array(np.array([object()]))


@pytest.mark.parametrize("tail", [b"\1\2\3", b"\0" * 8])
def test_trailing_bytes_are_rejected(tail):
    """Issue 15: np.load reads a payload with trailing bytes; the wire decoder refuses it."""
    good = to_array(np.arange(5.0))
    bad = Array(dtype=good.dtype, shape=tuple(good.shape), stype=good.stype, data=good.data + tail)
    with pytest.raises(ValueError, match="payload"):
        from_array(bad)


def test_payload_must_match_its_record():
    """A payload decoding to another shape or dtype than the record announces is refused."""
    other = Array(np.arange(6.0).reshape(2, 3))  # Flower's own bytes
    lying = Array(dtype="float64", shape=(6,), stype=other.stype, data=other.data)
    with pytest.raises(ValueError, match="announces"):
        from_array(lying)
    lying = Array(dtype="int64", shape=(2, 3), stype=other.stype, data=other.data)
    with pytest.raises(ValueError, match="announces"):
        from_array(lying)


CONFIG = {"task-id": 3, "server-round": 7, "m-tt": 2.5, "eval": True, "method": "mocha"}
METRICS = {"task-id": 3, "loss-mean": 0.25, "steps": 10}


def _flowers_and_ours() -> list[tuple[object, object]]:
    w = np.arange(4.0)
    ours = [config_record(CONFIG), metric_record(METRICS), array_record({"w": w})]
    flowers = [ConfigRecord(CONFIG), MetricRecord(METRICS), ArrayRecord({"w": Array(w)})]
    keys = ("config", "metrics", "arrays")
    ours.append(record_dict(dict(zip(keys, ours, strict=True))))
    flowers.append(RecordDict(dict(zip(keys, flowers, strict=True))))
    return list(zip(ours, flowers, strict=True))


@pytest.mark.parametrize("bulk", [True, False])
def test_bulk_built_records_are_flowers_records(monkeypatch, bulk):
    """Issue 17: the records built in one step equal Flower's own, to the bytes on the wire
    (object_id), and so do the ones built by the fallback (a Flower whose layout changed)."""
    assert wire._bulk_ok()
    if not bulk:
        monkeypatch.setattr(wire, "_BULK", [False])
    for ours, flowers in _flowers_and_ours():
        assert type(ours) is type(flowers) and ours == flowers
        assert ours.object_id == flowers.object_id
    config = ConfigRecord({"old": 1, "task-id": 0})
    old_id = config.object_id
    refill_config(config, CONFIG)  # in place: exactly the new values, a new object_id
    assert config == ConfigRecord(CONFIG) and config.object_id == ConfigRecord(CONFIG).object_id
    assert config.object_id != old_id
    arrays = ArrayRecord({"w": Array(np.zeros(2)), "junk": Array(np.ones(1))})
    old_id = arrays.object_id
    refill_arrays(arrays, {"w": np.arange(4.0)})
    fresh = ArrayRecord({"w": Array(np.arange(4.0))})
    assert arrays == fresh and arrays.object_id == fresh.object_id != old_id
    record = config_record(CONFIG)
    record["later"] = 1  # later writes go through Flower's checks
    with pytest.raises(TypeError):
        record["bad"] = object()  # type: ignore[assignment]


def test_values_of_other_types_take_flowers_checks():
    """Only exact bool/int/float/str skip Flower's checks; numpy scalars are still accepted
    as Flower accepts them, anything else is Flower's TypeError."""
    assert metric_record({"x": np.float64(0.5)}) == MetricRecord({"x": np.float64(0.5)})
    with pytest.raises(TypeError):
        config_record({"x": object()})
    with pytest.raises(TypeError):
        metric_record({"x": "text"})
    with pytest.raises(TypeError):
        record_dict({"x": {"not": "a record"}})  # type: ignore[dict-item]


def test_inputs_are_not_shared_with_the_records():
    values = dict(CONFIG)
    record = config_record(values)
    values["task-id"] = 99
    assert record["task-id"] == 3


def test_message_self_test_keeps_the_process_identity(monkeypatch):
    """The once-per-process check of message() / reply() builds its messages under the
    process's own TaskIdentity when it has one (a test identity only when it has none), so a
    message built meanwhile by another thread never carries the check's ids."""
    from flwr.supercore.task_identity import TaskIdentity

    for key, value in (("_run_id", 11), ("_node_id", 12), ("_task_id", 13)):
        monkeypatch.setattr(TaskIdentity, key, value)
    seen: list[tuple[int, int, int]] = []
    built = wire.message

    def spy(*args, **kwargs):
        seen.append((TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id))
        return built(*args, **kwargs)

    monkeypatch.setattr(wire, "message", spy)
    monkeypatch.setattr(wire, "_MESSAGES", [])
    assert wire._messages_ok()
    assert seen == [(11, 12, 13)]
    assert (TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id) == (11, 12, 13)


@pytest.mark.parametrize("bulk", [True, False])
def test_messages_built_in_one_step_are_flowers_messages(monkeypatch, bulk):
    """Issue 17: an instruction and a reply built by message() / reply() have Flower's
    metadata (ids, group, type, TTL), whether built in one step or by the fallback."""
    from flwr.app import Message, MessageType
    from flwr.supercore.task_identity import TaskIdentity

    assert wire._messages_ok()
    if not bulk:
        monkeypatch.setattr(wire, "_MESSAGES", [False])
    for key, value in (("_run_id", 11), ("_node_id", 1), ("_task_id", 4)):
        monkeypatch.setattr(TaskIdentity, key, value)
    content = record_dict({"config": config_record(CONFIG)})
    ours = wire.message(content, 1005, MessageType.TRAIN, "3")
    flowers = Message(content, 1005, MessageType.TRAIN, group_id="3")
    for sent in (ours, flowers):
        sent.metadata.__dict__["_message_id"] = "id-1"
    answers = (wire.reply(RecordDict(), flowers), Message(RecordDict(), reply_to=flowers))
    for mine, theirs in ((ours, flowers), answers):
        assert type(mine) is Message and mine.content == theirs.content
        a, b = mine.metadata, theirs.metadata
        for field in ("run_id", "message_id", "src_node_id", "dst_node_id", "src_task_id",
                      "dst_task_id", "reply_to_message_id", "group_id", "message_type",
                      "delivered_at"):
            assert getattr(a, field) == getattr(b, field), field
        assert abs(a.created_at - b.created_at) < 1.0 and abs(a.ttl - b.ttl) < 1.0
    assert answers[0].metadata.reply_to_message_id == "id-1"
    assert answers[0].metadata.dst_node_id == 1 and answers[0].metadata.src_node_id == 1005


def test_handed_over_values_make_the_same_records():
    """Issue 17: a dict handed over (the caller's own Python numbers) becomes the record as
    it is, equal to Flower's, with no per-value test; a plain_config check says when a
    caller's values qualify."""
    config = dict(CONFIG)
    ours = config_record(config, handed_over=True)
    assert ours == ConfigRecord(CONFIG) and ours.object_id == ConfigRecord(CONFIG).object_id
    metrics = metric_record(dict(METRICS), handed_over=True)
    assert metrics.object_id == MetricRecord(METRICS).object_id
    content = record_dict({"config": ours, "metrics": metrics}, handed_over=True)
    assert content.object_id == RecordDict({"config": ConfigRecord(CONFIG),
                                            "metrics": MetricRecord(METRICS)}).object_id
    assert wire.plain_config(CONFIG)
    assert not wire.plain_config({"seed": np.int64(3)}) and not wire.plain_config({1: 2})
