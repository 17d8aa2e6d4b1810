"""Validation of per-task design matrices and label vectors.

Every array that enters the package from outside (a ``.mat`` file, a generator, a user's
arrays) passes through :func:`validate_task`, so the rest of the code can rely on:

* ``X`` is a C-contiguous ``float64`` array of shape ``(n, d)`` with ``n >= 1`` and ``d >= 1``;
* ``y`` is a ``float64`` array of shape ``(n,)``;
* both are finite, and the labels are in the set the model expects (design decision 9:
  ``{-1, +1}`` for hinge and logistic models, ``{0, 1}`` for FedEM's models).

Errors are ``ValueError`` and always start with the ``name`` given by the caller (for example
``"/path/small.mat: task 5"``), so a bad file or partition is easy to find.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .dataset import LoadedTasks

__all__ = ["LABEL_SETS", "check_same_dim", "loaded_tasks", "node_task_id", "validate_task"]

#: Accepted label conventions and their allowed values.
LABEL_SETS: dict[str, tuple[float, float]] = {"pm1": (-1.0, 1.0), "01": (0.0, 1.0)}

_MAX_SHOWN = 5


def _format_values(values: np.ndarray) -> str:
    """Format at most ``_MAX_SHOWN`` distinct values, noting how many there are in all."""
    shown = ", ".join(f"{v:g}" for v in values[:_MAX_SHOWN])
    if values.size > _MAX_SHOWN:
        return f"[{shown}, ...] ({values.size} distinct values in all)"
    return f"[{shown}]"


def _as_float_array(a: Any, what: str, name: str) -> np.ndarray:
    """Convert ``a`` to a ``float64`` array, turning conversion failures into ValueError."""
    try:
        arr = np.asarray(a)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"dtype {arr.dtype} is not real numeric")
        return np.asarray(arr, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: {what} must be a real numeric array ({exc})") from exc


def _validate_arrays(X: Any, y: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Shape and finiteness checks shared by :func:`validate_task` and the splitter.

    Parameters
    ----------
    X, y : array_like
        Design matrix and labels of one task.
    name : str
        Prefix of every error message.

    Returns
    -------
    X : np.ndarray
        C-contiguous float64, shape ``(n, d)``.
    y : np.ndarray
        float64, shape ``(n,)``.
    """
    Xa = _as_float_array(X, "X", name)
    if Xa.ndim != 2:
        raise ValueError(f"{name}: X must be 2-D (samples x features), got shape {Xa.shape}")
    n, d = Xa.shape
    if n == 0:
        raise ValueError(f"{name}: X has no samples (shape {Xa.shape})")
    if d == 0:
        raise ValueError(f"{name}: X has no features (shape {Xa.shape})")
    ya = _as_float_array(y, "y", name)
    if ya.ndim == 2 and 1 in ya.shape:
        ya = ya.reshape(-1)
    if ya.ndim != 1:
        raise ValueError(f"{name}: y must be a vector (n,), (n, 1) or (1, n), got shape {ya.shape}")
    if ya.shape[0] != n:
        raise ValueError(f"{name}: y has {ya.shape[0]} labels but X has {n} samples")
    if not np.isfinite(Xa).all():
        bad = int(np.count_nonzero(~np.isfinite(Xa)))
        raise ValueError(f"{name}: X contains {bad} non-finite value(s) (NaN or Inf)")
    if not np.isfinite(ya).all():
        bad = int(np.count_nonzero(~np.isfinite(ya)))
        raise ValueError(f"{name}: y contains {bad} non-finite value(s) (NaN or Inf)")
    return np.ascontiguousarray(Xa), ya


def validate_task(
    X: Any, y: Any, *, labels: str = "pm1", name: str = "task"
) -> tuple[np.ndarray, np.ndarray]:
    """Validate and normalise one task's data.

    Parameters
    ----------
    X : array_like
        Design matrix, shape ``(n, d)``; any real dtype.
    y : array_like
        Labels, shape ``(n,)``, ``(n, 1)`` or ``(1, n)``; any real dtype (e.g. MATLAB int16).
    labels : {"pm1", "01"}, default "pm1"
        Label convention: ``"pm1"`` requires values in ``{-1, +1}``, ``"01"`` in ``{0, 1}``.
    name : str, default "task"
        Identifies the task (file and task index, or partition) in error messages.

    Returns
    -------
    X : np.ndarray
        C-contiguous float64 array of shape ``(n, d)`` (the input itself when it already is
        one; no copy is made then).
    y : np.ndarray
        float64 array of shape ``(n,)``.

    Raises
    ------
    ValueError
        If ``labels`` is not a known convention, ``X`` is not 2-D or has no samples or
        features, ``y`` has the wrong length or shape, any value is NaN or infinite, or a label
        is outside the allowed set (the message lists up to 5 offending distinct values).
    """
    if labels not in LABEL_SETS:
        raise ValueError(f"labels must be one of {sorted(LABEL_SETS)}, got {labels!r}")
    Xa, ya = _validate_arrays(X, y, name)
    allowed = np.asarray(LABEL_SETS[labels])
    bad = ~np.isin(ya, allowed)
    if bad.any():
        offending = np.unique(ya[bad])
        lo, hi = LABEL_SETS[labels]
        raise ValueError(
            f"{name}: labels must be in {{{lo:g}, {hi:g}}} (labels={labels!r}); "
            f"found {int(bad.sum())} label(s) with other values {_format_values(offending)}"
        )
    return Xa, ya


def _dim_of(task: Any) -> int:
    """Number of features of a design matrix or of a ``TaskData``-like object."""
    if hasattr(task, "X_train"):
        task = task.X_train
    shape = np.shape(task)
    if len(shape) != 2:
        raise ValueError(f"expected a 2-D design matrix, got shape {shape}")
    return int(shape[1])


def check_same_dim(tasks: Sequence[Any], *, name: str = "dataset") -> int:
    """Check that all tasks have the same number of features.

    Parameters
    ----------
    tasks : sequence
        Design matrices of shape ``(n_t, d_t)``, or objects with an ``X_train`` attribute
        (such as :class:`~fmtl_flower.data.dataset.TaskData`).
    name : str, default "dataset"
        Identifies the dataset in error messages.

    Returns
    -------
    int
        The common number of features ``d``.

    Raises
    ------
    ValueError
        If ``tasks`` is empty, or naming the first task whose ``d`` differs from task 0's.
    """
    if len(tasks) == 0:
        raise ValueError(f"{name}: no tasks")
    d0 = _dim_of(tasks[0])
    for t in range(1, len(tasks)):
        d = _dim_of(tasks[t])
        if d != d0:
            raise ValueError(
                f"{name}: task {t} has {d} features but task 0 has {d0}; "
                "all tasks must share the same feature dimension"
            )
    return d0


def loaded_tasks(tasks: Iterable[tuple[Any, Any, str, str]], *, name: str,
                 empty: str | None = None) -> LoadedTasks:
    """The tasks a paper dataset's reader yields, validated: what its loader returns.

    Parameters
    ----------
    tasks : iterable of (X, y, where, task_name)
        Each task's arrays (labels in ``{-1, +1}``), checked by :func:`validate_task` with
        ``name=where`` as they come, and what it is in the source.
    name : str
        Identifies the dataset in error messages (:func:`check_same_dim`).
    empty : str, optional
        If given, the ValueError ``"{name}: {empty}"`` when ``tasks`` yields none (else
        :func:`check_same_dim`'s).

    Returns
    -------
    LoadedTasks
    """
    Xs, ys, names = [], [], []
    for X, y, where, task_name in tasks:
        Xt, yt = validate_task(X, y, labels="pm1", name=where)
        Xs.append(Xt)
        ys.append(yt)
        names.append(task_name)
    if empty is not None and not Xs:
        raise ValueError(f"{name}: {empty}")
    check_same_dim(Xs, name=name)
    return LoadedTasks(Xs, ys, names)


def node_task_id(node_config: Any, missing: str) -> int:
    """The node's task id: ``task-id`` of its node config, else ``partition-id``.

    Parameters
    ----------
    node_config : mapping
        A Flower ``context.node_config``.
    missing : str
        The error message when neither key is set.

    Raises
    ------
    ValueError
        If the value is not an integer, or neither key is set (``missing``).
    """
    for key in ("task-id", "partition-id"):
        if key in node_config:
            value = node_config[key]
            try:
                return int(value)
            except (TypeError, ValueError):
                raise ValueError(f"node config {key}={value!r} is not an integer") from None
    raise ValueError(missing)
