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
constructors too (and their checks).
"""

from __future__ import annotations

import io
import math
from functools import lru_cache
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

NUMPY_STYPE = "numpy.ndarray"
_DTYPE_NAMES: dict[np.dtype, str] = {}  # str(dtype), which numpy computes slowly


@lru_cache(maxsize=256)
def _npy_header(dtype_str: str, shape: tuple[int, ...]) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype_str)),
                 "fortran_order": False, "shape": shape})
    return buffer.getvalue()


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
    try:
        header = _npy_header(array.dtype, tuple(array.shape))
    except (TypeError, ValueError):
        header = None
    data = array.data
    if header is not None and data.startswith(header):
        dtype = np.dtype(array.dtype)
        expected = math.prod(array.shape) * dtype.itemsize
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
    """A ``kind`` record holding ``values`` (a fresh dict), built without per-key checks."""
    empty = _EMPTY.get(kind)
    if empty is None:
        empty = _EMPTY[kind] = kind()
    record = empty.copy()  # Flower's own allocation without __init__
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


def refill_config(record: ConfigRecord, values: dict[str, Any]) -> None:
    """Make ``record`` hold exactly ``values`` (as :func:`config_record` would build it; in
    one step under the same conditions, else key by key through Flower's checks)."""
    if _bulk_ok() and type(record) is ConfigRecord and all(
            type(k) is str and type(v) in _CONFIG_TYPES for k, v in values.items()):
        _refill(record, dict(values))
        return
    record.clear()
    record.update(values)


def refill_arrays(record: ArrayRecord, arrays: dict[str, np.ndarray]) -> None:
    """Make ``record`` hold exactly ``arrays``, each encoded once (:func:`array_record`)."""
    encoded = {str(k): to_array(v) for k, v in arrays.items()}
    if _bulk_ok() and type(record) is ArrayRecord:
        _refill(record, encoded)
        return
    record.clear()
    record.update(encoded)


def config_record(values: dict[str, Any]) -> ConfigRecord:
    """``ConfigRecord(values)``, built in one step when every value is exactly a ``bool``,
    ``int``, ``float`` or ``str`` (anything else: Flower's constructor and its checks)."""
    if _bulk_ok() and all(type(k) is str and type(v) in _CONFIG_TYPES
                          for k, v in values.items()):
        return _filled(ConfigRecord, dict(values))
    return ConfigRecord(values)


def metric_record(values: dict[str, Any]) -> MetricRecord:
    """``MetricRecord(values)``, built in one step when every value is exactly an ``int`` or
    a ``float`` (anything else: Flower's constructor and its checks)."""
    if _bulk_ok() and all(type(k) is str and type(v) in _METRIC_TYPES
                          for k, v in values.items()):
        return _filled(MetricRecord, dict(values))
    return MetricRecord(values)


def array_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """An ``ArrayRecord`` of numpy arrays, each encoded once by :func:`to_array` (Flower's
    ``ArrayRecord({name: Array})`` copies every ``Array`` it is given)."""
    encoded = {str(k): to_array(v) for k, v in arrays.items()}
    if _bulk_ok():
        return _filled(ArrayRecord, encoded)
    return ArrayRecord(encoded)


_RECORD_TYPES = frozenset((ArrayRecord, ConfigRecord, MetricRecord))


def record_dict(records: dict[str, ArrayRecord | ConfigRecord | MetricRecord]) -> RecordDict:
    """``RecordDict(records)``, built in one step when every value is exactly an
    ``ArrayRecord``, ``ConfigRecord`` or ``MetricRecord`` (else Flower's constructor)."""
    if _bulk_ok() and all(type(k) is str and type(v) in _RECORD_TYPES
                          for k, v in records.items()):
        return _filled(RecordDict, dict(records))
    return RecordDict(records)
