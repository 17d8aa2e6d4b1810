"""Fast, validated conversion between numpy arrays and Flower ``Array`` records.

Flower's ``Array(ndarray)`` and ``Array.numpy()`` go through ``np.save``/``np.load``, whose
header parsing (``ast.literal_eval``) dominates the cost of a small message. The functions
here produce and read the *same* bytes (the ``.npy`` format, ``stype="numpy.ndarray"``), so
they interoperate with any Flower peer, but cache the header per (dtype, shape) and read the
payload with ``np.frombuffer`` when the header is the one this module writes. Any other
header falls back to Flower's own ``Array.numpy()``.
"""

from __future__ import annotations

import io
from functools import lru_cache

import numpy as np
from flwr.app import Array

NUMPY_STYPE = "numpy.ndarray"


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
    shape = tuple(int(s) for s in values.shape)
    dtype = str(values.dtype)
    if values.dtype.hasobject:
        raise TypeError("object arrays cannot be sent")
    return Array(dtype=dtype, shape=shape, stype=NUMPY_STYPE,
                 data=_npy_header(dtype, shape) + values.tobytes())


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
        expected = int(np.prod(array.shape, dtype=np.int64)) * dtype.itemsize
        if len(data) - len(header) != expected:
            raise ValueError(f"array payload of {len(data) - len(header)} bytes, its header "
                             f"announces {expected}")
        return np.frombuffer(data, dtype=dtype, offset=len(header)).reshape(array.shape)
    out = array.numpy()
    if out.shape != tuple(array.shape) or str(out.dtype) != array.dtype:
        raise ValueError(f"array payload holds {out.dtype} {out.shape}, its record announces "
                         f"{array.dtype} {tuple(array.shape)}")
    return out
