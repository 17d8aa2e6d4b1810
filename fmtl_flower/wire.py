"""Fast, validated conversion between numpy arrays and Flower ``Array`` records.

Flower's ``Array(ndarray)`` and ``Array.numpy()`` go through ``np.save``/``np.load``, whose
header parsing (``ast.literal_eval``) dominates the cost of a small message. The functions
here produce and read the *same* bytes (the ``.npy`` format, ``stype="numpy.ndarray"``), so
they interoperate with any Flower peer, but cache the header per (dtype, shape) and read the
payload with ``np.frombuffer`` when the header is the one this module writes. Any other
header falls back to Flower's own ``Array.numpy()``.

Records built in bulk. Flower checks every key and value it is given
(``ConfigRecord({...})`` runs a ``typing``-based check per entry, ``ArrayRecord({...})``
copies every ``Array`` it receives). :func:`config_record`, :func:`metric_record`,
:func:`array_record` and :func:`record_dict` build the *same* records (equal contents, equal
``object_id``: the same bytes on the wire) from values whose types are exactly Python's
``bool``/``int``/``float``/``str``, numpy arrays (encoded once, not copied again) or such
records (one cheap ``type()`` test per value). They fill Flower's record in one step, which
relies on the layout of Flower's ``TypedDict``; a self-test on first use compares the
results with Flower's own constructors and, should a Flower release change that layout,
every builder falls back to them. Values of any other type go through Flower's
constructors too (and their checks). With ``handed_over=True`` the builders skip even the
``type()`` tests and do not copy the dict: only for the code's own numbers (a strategy's
``tolist()`` values, a handler's own ``int()``/``float()`` results), never for values read
from a message -- those go through the receiving side's checks
(:mod:`fmtl_flower.strategies.discovery`'s ``read_metrics``, the handlers' ``config_value``).

Messages built in one step. :func:`message` and :func:`reply` build the ``Message`` that
Flower's constructor builds for an instruction and for a reply (same metadata: run and node
ids from Flower's ``TaskIdentity`` or from the message replied to, ``message_type``,
``group_id``, the default TTL, or the rest of the instruction's TTL; ``created_at`` from
the clock) without its argument parsing and checks, which cost more than the records of a
small message. They take only what the strategies and handlers here pass (a ``RecordDict``
built by :func:`record_dict`, a valid message type); a self-test on first use compares
their messages with Flower's, and every builder falls back to Flower's constructor should a
release change ``Message``'s or ``Metadata``'s layout.
"""

from __future__ import annotations

import io
import math
import time
from functools import lru_cache
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.constants import DEFAULT_TTL
from flwr.app.metadata import Metadata
from flwr.supercore.task_identity import TaskIdentity

NUMPY_STYPE = "numpy.ndarray"
_DTYPE_NAMES: dict[np.dtype, str] = {}  # str(dtype), which numpy computes slowly


@lru_cache(maxsize=256)
def _npy_header(dtype_str: str, shape: tuple[int, ...]) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype_str)),
                 "fortran_order": False, "shape": shape})
    return buffer.getvalue()


#: (dtype, shape) -> (this module's header, numpy dtype, payload bytes) of arrays read.
_LAYOUTS: dict[tuple[str, tuple[int, ...]], tuple[bytes, np.dtype, int]] = {}


def _layout(dtype_str: str, shape: tuple[int, ...]) -> tuple[bytes, np.dtype, int]:
    """What :func:`from_array` expects of an Array of ``dtype_str`` and ``shape`` (kept for
    the first 1024 layouts seen)."""
    header = _npy_header(dtype_str, shape)
    dtype = np.dtype(dtype_str)
    layout = (header, dtype, math.prod(shape) * dtype.itemsize)
    if len(_LAYOUTS) < 1024:
        _LAYOUTS[(dtype_str, shape)] = layout
    return layout


def to_array(values: np.ndarray) -> Array:
    """A Flower ``Array`` holding ``values`` (C order), byte-identical to ``Array(values)``."""
    values = np.asarray(values)
    if not values.flags.c_contiguous:
        values = np.ascontiguousarray(values)
    shape = values.shape  # a tuple of Python ints
    dtype = _DTYPE_NAMES.get(values.dtype)
    if dtype is None:
        if values.dtype.hasobject:
            raise TypeError("object arrays cannot be sent")
        dtype = _DTYPE_NAMES.setdefault(values.dtype, str(values.dtype))
    data = _npy_header(dtype, shape) + values.tobytes()
    if _bulk_ok():
        return _new_array(dtype, shape, data)
    return Array(dtype=dtype, shape=shape, stype=NUMPY_STYPE, data=data)


def _new_array(dtype: str, shape: tuple[int, ...], data: bytes) -> Array:
    array = Array.__new__(Array)
    array.__dict__.update(dtype=dtype, shape=shape, stype=NUMPY_STYPE, data=data)
    return array


def from_array(array: Array) -> np.ndarray:
    """The numpy array an ``Array`` holds (read-only when decoded on the fast path).

    Strict: the payload must be exactly the array its ``dtype`` and ``shape`` announce (a
    payload with this module's header and another length, or any payload decoding to
    another dtype or shape, is a ValueError), and only ``stype="numpy.ndarray"`` is read
    (TypeError otherwise).
    """
    if array.stype != NUMPY_STYPE:
        raise TypeError(f"unsupported array serialisation {array.stype!r}")
    data = array.data
    try:
        layout = _LAYOUTS.get((array.dtype, tuple(array.shape)))
        if layout is None:
            layout = _layout(array.dtype, tuple(array.shape))
    except (TypeError, ValueError):
        layout = None
    if layout is not None and data.startswith(layout[0]):
        header, dtype, expected = layout
        if len(data) - len(header) != expected:
            raise ValueError(f"array payload of {len(data) - len(header)} bytes, its header "
                             f"announces {expected}")
        return np.frombuffer(data, dtype=dtype, offset=len(header)).reshape(array.shape)
    out = array.numpy()
    if out.shape != tuple(array.shape) or str(out.dtype) != array.dtype:
        raise ValueError(f"array payload holds {out.dtype} {out.shape}, its record announces "
                         f"{array.dtype} {tuple(array.shape)}")
    return out


_CONFIG_TYPES = frozenset((bool, int, float, str))
_METRIC_TYPES = frozenset((int, float))
_EMPTY: dict[type, Any] = {}
_BULK: list[bool] = []  # [whether the bulk path builds Flower's records], after the self-test


def _filled(kind: type, values: dict[str, Any]) -> Any:
    """A ``kind`` record holding ``values`` (a fresh dict), built without per-key checks:
    what Flower's ``TypedDict.copy`` makes of an empty record (its allocation without
    ``__init__`` and its check functions), holding ``values``."""
    checks = _EMPTY.get(kind)
    if checks is None:
        empty = vars(kind())
        checks = _EMPTY[kind] = {key: empty[key] for key in ("_check_key_fn",
                                                               "_check_value_fn")}
    record = kind.__new__(kind)
    record.__dict__.update(checks)
    record.__dict__["_data"] = values
    return record


def _bulk_ok() -> bool:
    """Whether records built in bulk equal Flower's own (checked once per process)."""
    if not _BULK:
        _BULK.append(False)
        try:
            config = {"a": 1, "b": 2.5, "c": True, "d": "x"}
            metrics = {"a": 1, "b": 2.5}
            values = np.arange(3.0)
            data = _npy_header("float64", (3,)) + values.tobytes()
            fast_array = _new_array("float64", (3,), data)
            slow_array = Array(dtype="float64", shape=(3,), stype=NUMPY_STYPE, data=data)
            pairs = [(_filled(ConfigRecord, dict(config)), ConfigRecord(config)),
                     (_filled(MetricRecord, dict(metrics)), MetricRecord(metrics)),
                     (_filled(ArrayRecord, {"w": fast_array}), ArrayRecord({"w": slow_array}))]
            records = {"a": pairs[2][0], "m": pairs[1][0], "c": pairs[0][0]}
            pairs.append((_filled(RecordDict, dict(records)), RecordDict(records)))
            ok = fast_array.object_id == slow_array.object_id and all(
                type(f) is type(s) and f == s and dict(f.items()) == dict(s.items())
                and f.object_id == s.object_id for f, s in pairs)
            ok = ok and pairs[3][0].array_records == pairs[3][1].array_records
            refilled = ConfigRecord({"a": 0})
            before = refilled.object_id
            _refill(refilled, dict(config))
            ok = ok and refilled == pairs[0][1] and refilled.object_id == pairs[0][1].object_id \
                and refilled.object_id != before
            arrays = ArrayRecord({"w": Array(dtype="float64", shape=(0,), stype=NUMPY_STYPE,
                                             data=_npy_header("float64", (0,)))})
            before = arrays.object_id
            _refill(arrays, {"w": fast_array})
            ok = ok and arrays == pairs[2][1] and arrays.object_id == pairs[2][1].object_id \
                and arrays.object_id != before
            probe = _filled(ConfigRecord, {})
            probe["k"] = 1  # later writes still go through Flower's checks
            try:
                probe["j"] = object()  # type: ignore[assignment]
                ok = False
            except TypeError:
                pass
            _BULK[0] = bool(ok) and dict(probe.items()) == {"k": 1}
        except Exception:  # noqa: BLE001 - any surprise: use Flower's constructors
            _BULK[0] = False
    return _BULK[0]


def _refill(record: Any, values: dict[str, Any]) -> None:
    record.__dict__["_data"] = values
    if "_is_dirty" in record.__dict__:  # ArrayRecord: its object_id is recomputed
        record.__dict__["_is_dirty"] = True


def refill_config(record: ConfigRecord, values: dict[str, Any], *,
                  handed_over: bool = False) -> None:
    """Make ``record`` hold exactly ``values`` (as :func:`config_record` would build it; in
    one step under the same conditions, else key by key through Flower's checks;
    ``handed_over`` as for :func:`config_record`)."""
    if _bulk_ok() and type(record) is ConfigRecord and (handed_over or plain_config(values)):
        _refill(record, values if handed_over else dict(values))
        return
    record.clear()
    record.update(values)


def refill_arrays(record: ArrayRecord, arrays: dict[str, np.ndarray | Array]) -> None:
    """Make ``record`` hold exactly ``arrays``, each encoded once (:func:`array_record`)."""
    encoded = _encoded(arrays)
    if _bulk_ok() and type(record) is ArrayRecord:
        _refill(record, encoded)
        return
    record.clear()
    record.update(encoded)


def plain_config(values: dict[str, Any]) -> bool:
    """Whether every key of ``values`` is a ``str`` and every value exactly a ``bool``,
    ``int``, ``float`` or ``str`` (what :func:`config_record` takes in one step)."""
    return all(type(k) is str and type(v) in _CONFIG_TYPES for k, v in values.items())


def config_record(values: dict[str, Any], *, handed_over: bool = False) -> ConfigRecord:
    """``ConfigRecord(values)``, built in one step when every value is exactly a ``bool``,
    ``int``, ``float`` or ``str`` (anything else: Flower's constructor and its checks).

    ``handed_over``: ``values`` is a dict the caller made for this record alone, of ``str``
    keys and values it made of exactly those types (its own Python numbers): the record
    takes it as it is, without copying or looking at each value."""
    if _bulk_ok() and (handed_over or plain_config(values)):
        return _filled(ConfigRecord, values if handed_over else dict(values))
    return ConfigRecord(values)


def metric_record(values: dict[str, Any], *, handed_over: bool = False) -> MetricRecord:
    """``MetricRecord(values)``, built in one step when every value is exactly an ``int`` or
    a ``float`` (anything else: Flower's constructor and its checks); ``handed_over`` as for
    :func:`config_record`."""
    if _bulk_ok() and (handed_over or all(type(k) is str and type(v) in _METRIC_TYPES
                                          for k, v in values.items())):
        return _filled(MetricRecord, values if handed_over else dict(values))
    return MetricRecord(values)


def array_record(arrays: dict[str, np.ndarray | Array]) -> ArrayRecord:
    """An ``ArrayRecord`` of numpy arrays, each encoded once by :func:`to_array` (Flower's
    ``ArrayRecord({name: Array})`` copies every ``Array`` it is given), or of ``Array``s
    :func:`to_array` made (taken as they are)."""
    encoded = _encoded(arrays)
    if _bulk_ok():
        return _filled(ArrayRecord, encoded)
    return ArrayRecord(encoded)


def _encoded(arrays: dict[str, np.ndarray | Array]) -> dict[str, Array]:
    return {str(k): v if type(v) is Array else to_array(v) for k, v in arrays.items()}


_RECORD_TYPES = frozenset((ArrayRecord, ConfigRecord, MetricRecord))


def record_dict(records: dict[str, ArrayRecord | ConfigRecord | MetricRecord], *,
                handed_over: bool = False) -> RecordDict:
    """``RecordDict(records)``, built in one step when every value is exactly an
    ``ArrayRecord``, ``ConfigRecord`` or ``MetricRecord`` (else Flower's constructor);
    ``handed_over`` as for :func:`config_record` (records this module's builders made)."""
    if _bulk_ok() and (handed_over or all(type(k) is str and type(v) in _RECORD_TYPES
                                          for k, v in records.items())):
        return _filled(RecordDict, records if handed_over else dict(records))
    return RecordDict(records)


_MESSAGE_TYPES = frozenset(("train", "evaluate", "query", "query.whoami"))
_MESSAGES: list[bool] = []  # [whether message() and reply() build Flower's messages]


def _new_message(metadata: dict[str, Any], content: RecordDict) -> Message:
    meta = Metadata.__new__(Metadata)
    meta.__dict__.update(metadata)
    out = Message.__new__(Message)
    out.__dict__.update(_metadata=meta, _content=content, _error=None)
    return out


def message(content: RecordDict, dst_node_id: int, message_type: str,
            group_id: str = "") -> Message:
    """``Message(content, dst_node_id, message_type, group_id=group_id)``: an instruction
    with Flower's metadata, built in one step for the message types the strategies here send
    (``train``, ``evaluate``, ``query.whoami``; anything else: Flower's constructor)."""
    if (_messages_ok() and type(content) is RecordDict and type(dst_node_id) is int
            and message_type in _MESSAGE_TYPES and type(group_id) is str):
        return _new_message({
            "_run_id": TaskIdentity.run_id, "_message_id": "",
            "_src_node_id": TaskIdentity.node_id, "_dst_node_id": dst_node_id,
            "_src_task_id": TaskIdentity.task_id, "_dst_task_id": None,
            "_reply_to_message_id": "", "_group_id": group_id, "_created_at": time.time(),
            "_ttl": DEFAULT_TTL, "_message_type": message_type, "_delivered_at": ""},
            content)
    return Message(content, dst_node_id, message_type, group_id=group_id)


def reply(content: RecordDict, reply_to: Message) -> Message:
    """``Message(content, reply_to=reply_to)``: the reply to an instruction, with Flower's
    metadata (the instruction's ids swapped, its group and type, the rest of its TTL),
    built in one step."""
    if _messages_ok() and type(content) is RecordDict and type(reply_to) is Message:
        asked = reply_to.__dict__["_metadata"].__dict__
        if asked["_message_type"] in _MESSAGE_TYPES:
            current = time.time()
            return _new_message({
                "_run_id": asked["_run_id"], "_message_id": "",
                "_src_node_id": asked["_dst_node_id"], "_dst_node_id": asked["_src_node_id"],
                "_src_task_id": asked["_dst_task_id"], "_dst_task_id": asked["_src_task_id"],
                "_reply_to_message_id": asked["_message_id"], "_group_id": asked["_group_id"],
                "_created_at": current,
                "_ttl": asked["_created_at"] + asked["_ttl"] - current,
                "_message_type": asked["_message_type"], "_delivered_at": ""}, content)
    return Message(content, reply_to=reply_to)


def _messages_ok() -> bool:
    """Whether :func:`message` and :func:`reply` build Flower's messages (checked once per
    process against Flower's constructor: the same attributes, equal metadata but for the
    clock's ``created_at`` and ``ttl``)."""
    if not _MESSAGES:
        _MESSAGES.append(False)
        saved = {k: TaskIdentity.__dict__.get(k) for k in ("_run_id", "_node_id", "_task_id")}
        borrowed = not _identity_set()
        try:  # Flower's instruction reads the process's TaskIdentity: the process's own when
            # it has one (another thread may be building messages), else a test identity
            if borrowed:
                TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 2
            _MESSAGES[0] = True  # build ours for the comparison
            try:
                ours = message(RecordDict(), 5, "train", "3")
            finally:
                _MESSAGES[0] = False
            flowers = Message(RecordDict(), 5, "train", group_id="3")
            for sent in (ours, flowers):
                sent.metadata.__dict__["_message_id"] = "m1"
            _MESSAGES[0] = True
            try:
                answer = reply(RecordDict(), flowers)
            finally:
                _MESSAGES[0] = False
            pairs = ((ours, flowers), (answer, Message(RecordDict(), reply_to=flowers)))
            _MESSAGES[0] = all(_same_message(a, b) for a, b in pairs)
        except Exception:  # noqa: BLE001 - any surprise: Flower's constructor
            _MESSAGES[0] = False
        finally:
            if borrowed:
                for key, value in saved.items():
                    setattr(TaskIdentity, key, value)
    return _MESSAGES[0]


def _identity_set() -> bool:
    """Whether this process has a Flower ``TaskIdentity`` (Flower's ``Message`` constructor
    raises without one)."""
    try:
        return all(v is not None for v in (TaskIdentity.run_id, TaskIdentity.node_id,
                                           TaskIdentity.task_id))
    except Exception:  # noqa: BLE001 - unset: Flower raises
        return False


def _same_message(ours: Message, flowers: Message) -> bool:
    if type(ours) is not Message or set(vars(ours)) != set(vars(flowers)) \
            or type(ours.metadata) is not Metadata or ours.has_error():
        return False
    a, b = dict(vars(ours.metadata)), dict(vars(flowers.metadata))
    clock = ("_created_at", "_ttl")
    return (set(a) == set(b) and all(a[k] == b[k] for k in a if k not in clock)
            and all(abs(a[k] - b[k]) < 5.0 for k in clock)
            and ours.metadata.message_type == flowers.metadata.message_type)
