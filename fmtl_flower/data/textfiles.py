"""Parse whitespace-separated numeric text files with errors that name the file and line."""

from __future__ import annotations

import numpy as np

__all__ = ["parse_int_column", "parse_table"]


def _data_lines(text: str) -> list[tuple[int, str]]:
    """Non-blank lines with their 1-based line numbers."""
    return [(i, ln) for i, ln in enumerate(text.splitlines(), start=1) if ln.strip()]


def parse_table(text: str, where: str, ncols: int | None = None) -> np.ndarray:
    """Parse a whitespace-separated table of numbers (one row per non-blank line).

    Parameters
    ----------
    text : str
        File contents. Any numeric format ``float()`` accepts (``2.8858451e-001`` included).
    where : str
        The file, for error messages.
    ncols : int, optional
        Required number of columns; default: that of the first row.

    Returns
    -------
    np.ndarray
        float64, shape ``(rows, ncols)``; ``(0, ncols or 0)`` for an empty file.

    Raises
    ------
    ValueError
        Naming ``where`` and the first offending line: a non-numeric entry, a row with the
        wrong number of columns, or a NaN/infinite value.
    """
    lines = _data_lines(text)
    if not lines:
        return np.zeros((0, ncols or 0))
    if ncols is None:
        ncols = len(lines[0][1].split())
    try:
        flat = np.array(text.split(), dtype=np.float64)
    except ValueError:
        flat = None
    if flat is None or flat.size != len(lines) * ncols:
        for lineno, line in lines:
            fields = line.split()
            if len(fields) != ncols:
                raise ValueError(
                    f"{where}: line {lineno} has {len(fields)} values, expected {ncols}"
                ) from None
            try:
                [float(f) for f in fields]
            except ValueError as exc:
                raise ValueError(f"{where}: line {lineno}: not a number ({exc})") from None
        raise ValueError(f"{where}: could not parse as a {ncols}-column numeric table")
    table = flat.reshape(len(lines), ncols)
    bad = ~np.isfinite(table)
    if bad.any():
        row = int(np.flatnonzero(bad.any(axis=1))[0])
        raise ValueError(f"{where}: line {lines[row][0]} holds a NaN or infinite value")
    return table


def parse_int_column(text: str, where: str) -> np.ndarray:
    """Parse one integer per non-blank line (``4``, ``4.0`` and `` 4`` are all 4).

    Raises
    ------
    ValueError
        Naming ``where`` and the first line that is not a single integer.
    """
    table = parse_table(text, where, ncols=1)
    col = table[:, 0]
    frac = col != np.round(col)
    if frac.any():
        lineno = _data_lines(text)[int(np.flatnonzero(frac)[0])][0]
        raise ValueError(f"{where}: line {lineno} is not an integer")
    return col.astype(np.int64)
