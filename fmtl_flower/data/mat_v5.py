"""A minimal reader of MATLAB 5 ``.mat`` files for devices without scipy.

The base install (a SuperNode's venv) has numpy but not scipy, yet a device may serve a task
of a built-in ``.mat`` dataset. This module reads what those files hold: numeric, logical
and character arrays, sparse matrices (returned dense) and cell arrays of them, in either
byte order, with or without zlib compression (``miCOMPRESSED``, MATLAB's default since 7).
Structs, objects, functions and MAT 7.3 (HDF5) files are refused with a clear error.

Layout (MATLAB's "MAT-File Format", level 5): a 128-byte header (text, subsystem offset,
version, the endian indicator ``IM``/``MI``), then data elements, each an 8-byte tag (type,
byte count) or a 4-byte "small element" tag with up to 4 bytes of data, padded to 8 bytes.
A variable is an ``miMATRIX`` element: array flags (class), dimensions, name, then the data
sub-elements. Arrays are stored column-major.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np

__all__ = ["MatFormatError", "read_mat_v5"]

_MI_INT8, _MI_INT32, _MI_UINT32, _MI_MATRIX, _MI_COMPRESSED, _MI_UTF8 = 1, 5, 6, 14, 15, 16
#: MAT data types -> numpy dtypes (byte order added per file).
_MI_DTYPES = {1: "i1", 2: "u1", 3: "i2", 4: "u2", 5: "i4", 6: "u4", 7: "f4", 9: "f8",
              12: "i8", 13: "u8", 16: "u1", 17: "u2", 18: "u4"}
_MX_CELL, _MX_STRUCT, _MX_OBJECT, _MX_CHAR, _MX_SPARSE = 1, 2, 3, 4, 5
#: numeric array classes: double, single, int8 .. uint64
_MX_NUMERIC = range(6, 16)
_FLAG_COMPLEX, _FLAG_LOGICAL = 0x800, 0x200


class MatFormatError(ValueError):
    """The file is not a MATLAB 5 ``.mat`` file this reader understands."""


class _Elements:
    """Iterates over the data elements of a byte buffer in the file's byte order."""

    def __init__(self, data: bytes, order: str) -> None:
        self.data, self.order, self.pos = data, order, 0

    def _u32(self, offset: int) -> int:
        return int(np.frombuffer(self.data, self.order + "u4", 1, offset)[0])

    def next(self) -> tuple[int, bytes] | None:
        """The next element's ``(type, payload)``, or None at the end."""
        if self.pos + 8 > len(self.data):  # every element (tag included) takes 8+ bytes
            return None
        first = self._u32(self.pos)
        if first >> 16:  # small data element: size in the upper half, data in 4 bytes
            mtype, size = first & 0xFFFF, first >> 16
            if size > 4:
                raise MatFormatError(f"small data element of {size} bytes (at most 4)")
            payload = self.data[self.pos + 4:self.pos + 4 + size]
            self.pos += 8
            return mtype, payload
        mtype, size = first, self._u32(self.pos + 4)
        start = self.pos + 8
        if start + size > len(self.data):
            raise MatFormatError(f"element of {size} bytes runs past the end of the data")
        payload = self.data[start:start + size]
        # compressed elements are not padded; every other element ends on 8 bytes
        self.pos = start + (size if mtype == _MI_COMPRESSED else -(-size // 8) * 8)
        return mtype, payload

    def expect(self, what: str) -> tuple[int, bytes]:
        element = self.next()
        if element is None:
            raise MatFormatError(f"truncated array: no {what}")
        return element


def _numbers(mtype: int, payload: bytes, order: str) -> np.ndarray:
    if mtype not in _MI_DTYPES:
        raise MatFormatError(f"unsupported data type {mtype}")
    return np.frombuffer(payload, order + _MI_DTYPES[mtype])


def _matrix(payload: bytes, order: str) -> tuple[str, Any]:
    """Decode one ``miMATRIX`` element: ``(name, value)``."""
    if not payload:  # an empty matrix element (e.g. an empty cell)
        return "", np.zeros((0, 0))
    parts = _Elements(payload, order)
    flags = _numbers(*parts.expect("array flags"), order).astype(np.uint32)
    mx_class, bits = int(flags[0]) & 0xFF, int(flags[0])
    dims = tuple(int(d) for d in _numbers(*parts.expect("dimensions"), order))
    name = parts.expect("array name")[1].decode("latin-1")
    if mx_class == _MX_CELL:
        cells = np.empty(int(np.prod(dims)), dtype=object)
        for i in range(cells.size):
            mtype, sub = parts.expect(f"cell {i}")
            if mtype != _MI_MATRIX:
                raise MatFormatError(f"cell {i} of {name!r} is not an array (type {mtype})")
            cells[i] = _matrix(sub, order)[1]
        return name, cells.reshape(dims, order="F")
    if mx_class == _MX_SPARSE:
        return name, _sparse(parts, dims, bits, order)
    if mx_class in (_MX_STRUCT, _MX_OBJECT) or mx_class not in (*_MX_NUMERIC, _MX_CHAR):
        raise MatFormatError(f"variable {name!r}: MATLAB class {mx_class} (struct, object or "
                             "function) is not supported without scipy")
    if mx_class == _MX_CHAR:
        return name, _chars(*parts.expect("characters"), dims, order)
    real = _numbers(*parts.expect("real part"), order)
    # the stored type, as scipy.io.loadmat gives it by default (its mat_dtype=False): the
    # reference files store {-1, +1} labels as int16 in arrays of class double
    values = real.astype(real.dtype.newbyteorder("="))
    if bits & _FLAG_COMPLEX:
        values = values + 1j * _numbers(*parts.expect("imaginary part"), order)
    return name, values.reshape(dims, order="F")


def _chars(mtype: int, payload: bytes, dims: tuple[int, ...], order: str) -> np.ndarray:
    """A character array as scipy gives it: one string per row (none if it is empty)."""
    if 0 in dims:
        return np.array([], dtype="<U1")
    if mtype == _MI_UTF8:
        codes = np.array([ord(c) for c in payload.decode("utf-8", errors="replace")])
    else:
        codes = _numbers(mtype, payload, order)
    if codes.size != int(np.prod(dims)):
        return np.array(["".join(map(chr, codes))])
    grid = codes.reshape(dims[0], -1, order="F")
    return np.array(["".join(map(chr, row)) for row in grid])


def _sparse(parts: _Elements, dims: tuple[int, ...], bits: int, order: str) -> np.ndarray:
    """A MATLAB sparse matrix (compressed sparse columns), returned dense in the stored type
    (bool if logical)."""
    rows = _numbers(*parts.expect("sparse row indices"), order).astype(np.int64)
    col_starts = _numbers(*parts.expect("sparse column starts"), order).astype(np.int64)
    mtype, payload = parts.expect("sparse values")
    if bits & _FLAG_LOGICAL:  # one byte per entry, whatever type the tag claims
        values = np.frombuffer(payload, np.uint8) != 0
    else:
        values = _numbers(mtype, payload, order)
        values = values.astype(values.dtype.newbyteorder("="))
    if bits & _FLAG_COMPLEX:
        values = values + 1j * _numbers(*parts.expect("sparse imaginary part"), order)
    n_rows, n_cols = dims
    if col_starts.size != n_cols + 1 or col_starts[-1] > min(rows.size, values.size):
        raise MatFormatError("sparse matrix: column starts do not match its entries")
    dense = np.zeros((n_rows, n_cols), dtype=values.dtype)
    cols = np.repeat(np.arange(n_cols), np.diff(col_starts))
    nnz = int(col_starts[-1])
    np.add.at(dense, (rows[:nnz], cols), values[:nnz])
    return dense


def read_mat_v5(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read the variables of a MATLAB 5 ``.mat`` file.

    Parameters
    ----------
    path : str or os.PathLike
        The file.

    Returns
    -------
    dict of str to Any
        Variable name -> value: numeric and logical arrays as ``np.ndarray`` of MATLAB's
        shape (at least 2-D) and class, sparse matrices dense, character arrays as a 1-element
        string array, cell arrays as ``object`` arrays of such values (as
        ``scipy.io.loadmat`` gives them, except that sparse matrices come back dense).

    Raises
    ------
    MatFormatError
        If the file is not a MATLAB 5 file (too short, no endian indicator, a MAT 7.3/HDF5
        file), is truncated or corrupt, or holds a struct, object or function.
    """
    with open(path, "rb") as handle:
        data = handle.read()
    if len(data) < 128:
        raise MatFormatError("too short for a MATLAB 5 header")
    endian = data[126:128]
    if endian not in (b"IM", b"MI"):
        raise MatFormatError("no MATLAB 5 endian indicator in the header")
    order = "<" if endian == b"IM" else ">"
    version = int(np.frombuffer(data, order + "u2", 1, 124)[0])
    if version == 0x0200:
        raise MatFormatError("a MATLAB 7.3 (HDF5) file; save it with -v7 or read it with h5py")
    if version != 0x0100:
        raise MatFormatError(f"unknown MAT-file version {version:#06x} in the header")
    elements = _Elements(data[128:], order)
    variables: dict[str, Any] = {}
    while (element := elements.next()) is not None:
        mtype, payload = element
        if mtype == _MI_COMPRESSED:
            try:
                payload = zlib.decompress(payload)
            except zlib.error as err:
                raise MatFormatError(f"corrupt compressed element ({err})") from err
            inner = _Elements(payload, order).next()
            if inner is None:
                continue
            mtype, payload = inner
        if mtype != _MI_MATRIX:
            continue  # e.g. subsystem data: not a variable
        name, value = _matrix(payload, order)
        variables[name] = value
    return variables
