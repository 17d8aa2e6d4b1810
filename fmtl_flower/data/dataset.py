"""Containers for federated multi-task datasets: one :class:`TaskData` per task (client).

The containers are frozen dataclasses holding numpy arrays. They compare by identity
(``eq=False``): element-wise comparison of arrays has no single truth value, and identity
hashing lets a cached dataset be used as a dictionary key.

:class:`MultiTaskDataset` was called ``FederatedDataset`` in 0.1; the old name, which
clashes with ``flwr_datasets.FederatedDataset``, still works for one release and warns
(``DeprecationWarning``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

import numpy as np

__all__ = ["LoadedTasks", "MultiTaskDataset", "TaskCollection", "TaskData", "TrainTestParts"]

#: A design matrix's type: ``np.ndarray`` (dense) or ``scipy.sparse.csr_matrix``.
XT = TypeVar("XT")

#: Names kept for one release after a rename: old name -> new name.
DEPRECATED_NAMES = {"FederatedDataset": "MultiTaskDataset"}


def deprecated_alias(module: str, name: str, namespace: dict[str, Any]) -> Any:
    """The object an old name of :data:`DEPRECATED_NAMES` stands for, with a
    ``DeprecationWarning`` (``AttributeError`` for any other name), for a module's
    ``__getattr__``."""
    if name not in DEPRECATED_NAMES:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new = DEPRECATED_NAMES[name]
    warnings.warn(f"{module}.{name} is deprecated and will be removed in the next release; "
                  f"use {new} (renamed so that it does not clash with "
                  f"flwr_datasets.FederatedDataset)", DeprecationWarning, stacklevel=3)
    return namespace[new]


def __getattr__(name: str) -> Any:
    return deprecated_alias(__name__, name, globals())


def _freeze_task(task: Any) -> Any:
    """Make every array of ``task`` (dense or CSR) read-only, in place; return ``task``."""
    for arr in task.arrays():
        if isinstance(arr, np.ndarray):
            arr.setflags(write=False)
        else:  # a CSR matrix: its three arrays
            for part in (arr.data, arr.indices, arr.indptr):
                part.setflags(write=False)
    return task


class LoadedTasks(NamedTuple):
    """Per-task arrays read from a dataset, before any split (what the paper loaders return).

    Attributes
    ----------
    Xs : list of np.ndarray
        Per-task C-contiguous float64 design matrices, each ``(n_t, d)``.
    ys : list of np.ndarray
        Per-task float64 labels in ``{-1, +1}``, each ``(n_t,)``.
    task_names : list of str
        What each task is in the source (``"subject 7"``, ``"n41"``, a participant folder),
        in task order.
    """

    Xs: list[np.ndarray]
    ys: list[np.ndarray]
    task_names: list[str]


class TrainTestParts(Generic[XT]):
    """What a task's train and test parts (``X_train``, ``y_train``, ``X_test``, ``y_test``)
    give, dense (:class:`TaskData`) or sparse
    (:class:`~fmtl_flower.data.sparse_federated.SparseTaskData`): the sizes, ``d``,
    :meth:`arrays` and the shape checks of their ``__post_init__``."""

    X_train: XT
    y_train: np.ndarray
    X_test: XT
    y_test: np.ndarray

    def _check_parts(self, check_X: Callable[[Any, str], Any],
                     check_y: Callable[[np.ndarray, str], None] | None = None) -> None:
        """Per part (train, then test): ``check_X(X, "X_part")``, ``y`` 1-D, as many rows
        as ``X``, then ``check_y(y, "y_part")``; then train and test with the same ``d``.
        ValueError naming the array."""
        for part in ("train", "test"):
            X = getattr(self, f"X_{part}")
            y = getattr(self, f"y_{part}")
            check_X(X, f"X_{part}")
            if np.ndim(y) != 1:
                raise ValueError(f"y_{part} must be 1-D, got shape {np.shape(y)}")
            if np.shape(X)[0] != np.shape(y)[0]:
                raise ValueError(
                    f"X_{part} has {np.shape(X)[0]} rows but y_{part} has {np.shape(y)[0]}"
                )
            if check_y is not None:
                check_y(y, f"y_{part}")
        if np.shape(self.X_train)[1] != np.shape(self.X_test)[1]:
            raise ValueError(
                f"X_train has {np.shape(self.X_train)[1]} features but X_test has "
                f"{np.shape(self.X_test)[1]}"
            )

    @property
    def n_train(self) -> int:
        """Number of training samples (rows)."""
        return int(self.X_train.shape[0])

    @property
    def n_test(self) -> int:
        """Number of test samples (may be 0)."""
        return int(self.X_test.shape[0])

    @property
    def dim(self) -> int:
        """Number of features ``d``."""
        return int(self.X_train.shape[1])

    def arrays(self) -> tuple[XT, np.ndarray, XT, np.ndarray]:
        """Return ``(X_train, y_train, X_test, y_test)``."""
        return self.X_train, self.y_train, self.X_test, self.y_test


def _check_2d(X: Any, what: str) -> None:
    if np.ndim(X) != 2:
        raise ValueError(f"{what} must be 2-D, got shape {np.shape(X)}")


@dataclass(frozen=True, eq=False)
class TaskData(TrainTestParts[np.ndarray]):
    """Train and test data of one task.

    Parameters
    ----------
    X_train : np.ndarray
        Training design matrix, float64, shape ``(n_train, d)``.
    y_train : np.ndarray
        Training labels, float64, shape ``(n_train,)``.
    X_test : np.ndarray
        Test design matrix, float64, shape ``(n_test, d)``; ``n_test`` may be 0.
    y_test : np.ndarray
        Test labels, float64, shape ``(n_test,)``.

    Raises
    ------
    ValueError
        If the shapes are inconsistent (not 2-D / 1-D, length mismatch, or train and test
        with different ``d``).
    """

    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray

    def __post_init__(self) -> None:
        self._check_parts(_check_2d)


class TaskCollection:
    """Views shared by the dataset containers (dense :class:`MultiTaskDataset` and the sparse
    one of :mod:`fmtl_flower.data.sparse_federated`): a subclass has ``name`` and ``tasks``,
    each task ``n_train``, ``n_test`` and ``dim``.

    ``lazy`` is False here; the lazy datasets of :mod:`fmtl_flower.data.lazy`
    (:class:`~fmtl_flower.data.lazy.LazyFederatedDataset`, a subclass of
    :class:`MultiTaskDataset` whose ``tasks`` generates task ``t`` when accessed) set it."""

    #: Whether ``tasks`` generates each task on access (:mod:`fmtl_flower.data.lazy`).
    lazy: ClassVar[bool] = False
    name: str
    tasks: tuple

    @property
    def num_tasks(self) -> int:
        """Number of tasks ``m``."""
        return len(self.tasks)

    @property
    def dim(self) -> int:
        """Common number of features ``d``."""
        return self.tasks[0].dim

    @property
    def n_train(self) -> np.ndarray:
        """Per-task training sample counts, int64 array of shape ``(num_tasks,)``."""
        return np.array([task.n_train for task in self.tasks], dtype=np.int64)

    @property
    def n_test(self) -> np.ndarray:
        """Per-task test sample counts, int64 array of shape ``(num_tasks,)``."""
        return np.array([task.n_test for task in self.tasks], dtype=np.int64)

    def task(self, t: int) -> Any:
        """Return task ``t``.

        Parameters
        ----------
        t : int
            Task id in ``0 .. num_tasks - 1`` (negative indices are not accepted).

        Returns
        -------
        TaskData

        Raises
        ------
        IndexError
            If ``t`` is out of range.
        TypeError
            If ``t`` is not an integer.
        """
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise TypeError(f"task id must be an int, got {type(t).__name__}")
        if not 0 <= t < self.num_tasks:
            raise IndexError(
                f"dataset {self.name!r}: task id {t} out of range; valid ids are "
                f"0..{self.num_tasks - 1} ({self.num_tasks} tasks)"
            )
        return self.tasks[int(t)]

    def _store_tasks(self, task_type: type) -> None:
        """Store ``tasks`` as a tuple (a frozen dataclass's ``__post_init__``): ValueError if
        there are none or their ``d`` differ, TypeError for an entry not a ``task_type``."""
        tasks = tuple(self.tasks)
        object.__setattr__(self, "tasks", tasks)
        if not tasks:
            raise ValueError(f"dataset {self.name!r}: no tasks")
        for t, task in enumerate(tasks):
            if not isinstance(task, task_type):
                raise TypeError(f"dataset {self.name!r}: task {t} is {type(task).__name__}, "
                                f"not {task_type.__name__}")
        d0 = tasks[0].dim
        for t, task in enumerate(tasks):
            if task.dim != d0:
                raise ValueError(
                    f"dataset {self.name!r}: task {t} has {task.dim} features but task 0 has {d0}"
                )

    def _parts(self, part: str) -> tuple[tuple[Any, ...], tuple[np.ndarray, ...]]:
        """``(Xs, ys)``: every task's ``X_{part}`` and ``y_{part}`` (``part`` is ``"train"`` or
        ``"test"``), task 0 first, reading ``tasks`` once (a lazy dataset generates each task
        once, streaming)."""
        Xs, ys = zip(
            *((getattr(t, f"X_{part}"), getattr(t, f"y_{part}")) for t in self.tasks), strict=True
        )
        return Xs, ys


@dataclass(frozen=True, eq=False)
class MultiTaskDataset(TaskCollection):
    """A named collection of tasks that share the feature dimension.

    Parameters
    ----------
    name : str
        Dataset name (``"synthetic"``, ``"small"``, ``"eat-voc"`` or a file stem).
    tasks : tuple of TaskData
        One entry per task; task ids are the positions ``0 .. num_tasks - 1``. Any sequence
        is accepted and stored as a tuple.

    Raises
    ------
    ValueError
        If there are no tasks or the tasks differ in ``d``.
    TypeError
        If an entry is not a :class:`TaskData`.
    """

    name: str
    tasks: tuple[TaskData, ...]

    def __post_init__(self) -> None:
        self._store_tasks(TaskData)

    def pooled_train(self) -> tuple[np.ndarray, np.ndarray]:
        """Stack all tasks' training data (task 0 first).

        Returns
        -------
        X : np.ndarray
            Shape ``(sum n_train, d)``.
        y : np.ndarray
            Shape ``(sum n_train,)``.
        """
        return _stack(*self._parts("train"))

    def pooled_test(self) -> tuple[np.ndarray, np.ndarray]:
        """Stack all tasks' test data (task 0 first).

        Returns
        -------
        X : np.ndarray
            Shape ``(sum n_test, d)``.
        y : np.ndarray
            Shape ``(sum n_test,)``.
        """
        return _stack(*self._parts("test"))


def _stack(Xs: Sequence[np.ndarray], ys: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Vertically stack design matrices and concatenate labels."""
    return np.vstack(Xs), np.concatenate(ys)
