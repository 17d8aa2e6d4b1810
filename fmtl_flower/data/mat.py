"""Loader for the MATLAB ``.mat`` multi-task files of the reference implementations.

Two layouts are supported (reference_algorithms.md, section 10):

* ``X`` / ``Y`` (MOCHA's ``small.mat``), and
* ``X_ori`` / ``Y_ori`` (OFMTL's ``EAT_VOC.mat``),

each a ``1 x m`` cell array: cell ``t`` of ``X`` is task ``t``'s ``n_t x d`` design matrix and
cell ``t`` of ``Y`` its ``n_t x 1`` label column (int16 in the files, ``{-1, +1}``).

Files are read with ``scipy.io.loadmat`` where scipy is installed (servers, simulations) and
with the built-in MAT 5 reader :mod:`fmtl_flower.data.mat_v5` on a base install without
scipy (devices), which gives the same arrays.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fmtl_flower._lazy import lazy_module
from fmtl_flower.data.mat_v5 import read_mat_v5
from fmtl_flower.data.validation import check_same_dim, validate_task

scipy_io = lazy_module("scipy.io")  # loaded with the first .mat file
scipy_sparse = lazy_module("scipy.sparse")

__all__ = ["MAT_KEY_PAIRS", "load_mat_tasks"]

#: Accepted (design matrices, labels) variable-name pairs, in order of preference.
MAT_KEY_PAIRS: tuple[tuple[str, str], ...] = (("X", "Y"), ("X_ori", "Y_ori"))


def _is_sparse(value: Any) -> bool:
    """Whether ``value`` is a scipy sparse matrix (never, if scipy.sparse was never loaded)."""
    return "scipy.sparse" in sys.modules and scipy_sparse.issparse(value)


def _read_variables(path: Path) -> dict[str, Any]:
    """The file's variables: ``scipy.io.loadmat`` if scipy is installed, else the built-in
    MAT 5 reader (a device's base install)."""
    try:
        import scipy.io  # noqa: F401 (only whether it imports)
    except ImportError:
        return read_mat_v5(path)
    return scipy_io.loadmat(path)


def _cells(value: Any, key: str, path: Path) -> list[Any]:
    """Return the entries of a MATLAB cell array stored as a 1 x m (or m x 1) object array."""
    arr = np.asarray(value) if not _is_sparse(value) else None
    if arr is None or arr.dtype != object or arr.ndim != 2 or 1 not in arr.shape:
        shape = getattr(value, "shape", None)
        raise ValueError(
            f"{path}: variable {key!r} must be a 1 x m cell array (one cell per task), "
            f"got {type(value).__name__} of shape {shape}"
        )
    return list(arr.reshape(-1))


def _dense(cell: Any) -> Any:
    """Densify a sparse cell (MATLAB sparse matrices load as scipy.sparse)."""
    if _is_sparse(cell):
        return cell.toarray()
    return cell


def load_mat_tasks(path: str | os.PathLike[str]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Read the per-task data of a multi-task ``.mat`` file.

    Parameters
    ----------
    path : str or os.PathLike
        A MATLAB 5 ``.mat`` file with the variables ``X``/``Y`` or ``X_ori``/``Y_ori``.

    Returns
    -------
    Xs : list of np.ndarray
        Per-task C-contiguous float64 design matrices, each ``(n_t, d)``.
    ys : list of np.ndarray
        Per-task float64 label vectors in ``{-1, +1}``, each ``(n_t,)``.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        If the file is not a readable MAT file, has neither key pair (the message lists the
        variables found and the accepted pairs), the cell counts of X and Y differ, there are
        no tasks, a task is invalid (the message names the file and task index), or the tasks
        differ in ``d``.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"MAT file not found: {p}")
    if not p.is_file():
        raise ValueError(f"{p}: not a regular file")
    try:
        contents = _read_variables(p)
    except Exception as exc:  # scipy raises many types on corrupt input; report them all
        raise ValueError(f"{p}: not a readable MATLAB 5 .mat file ({exc})") from exc
    keys = sorted(k for k in contents if not k.startswith("__"))
    pair = next((kp for kp in MAT_KEY_PAIRS if kp[0] in contents and kp[1] in contents), None)
    if pair is None:
        accepted = " or ".join(f"{kx!r}/{ky!r}" for kx, ky in MAT_KEY_PAIRS)
        raise ValueError(f"{p}: found variables {keys}; expected the pair {accepted}")
    kx, ky = pair
    x_cells = _cells(contents[kx], kx, p)
    y_cells = _cells(contents[ky], ky, p)
    if len(x_cells) != len(y_cells):
        raise ValueError(
            f"{p}: {kx!r} has {len(x_cells)} cells but {ky!r} has {len(y_cells)}; "
            "need one design matrix and one label vector per task"
        )
    if not x_cells:
        raise ValueError(f"{p}: {kx!r} and {ky!r} are empty (no tasks)")
    Xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for t, (xc, yc) in enumerate(zip(x_cells, y_cells, strict=True)):
        X, y = validate_task(_dense(xc), _dense(yc), labels="pm1", name=f"{p}: task {t}")
        Xs.append(X)
        ys.append(y)
    check_same_dim(Xs, name=str(p))
    return Xs, ys
