"""Lazy federated datasets: task ``t`` is generated (and split) when it is accessed.

The generated datasets seed every task on its own (``"synthetic"``: task ``t`` from
``default_rng([seed, t, 0x5E])``, its split from ``default_rng([seed, t, 7])``, its skew from
``default_rng([seed, t, 61])``; non-IID ``"sparse-federated"``: node ``t`` and its split from
``default_rng([seed, t, 0x5F1])``), so task ``t`` can be drawn without the others, and
bit-identically to the same task of the eagerly built dataset. For a large federation (10^5
tasks) the lazy dataset never holds all tasks at once; memory stays flat in ``num_tasks``:

* :class:`LazyTasks` is the ``tasks`` sequence: ``tasks[t]`` (and ``dataset.task(t)``)
  generates task ``t``, keeping the last :data:`DEFAULT_CACHE_SIZE` (64) accessed tasks in an
  LRU cache so that repeated access within a round is cheap; iterating streams the tasks one
  by one (it does not fill the cache). Every array of a lazy task is read-only (as in
  :func:`~fmtl_flower.data.registry.load_dataset_cached`), so a cached task cannot be
  changed by a caller. ``n_train`` / ``n_test`` stream through the tasks once (``O(m)`` time,
  flat memory) and keep the two small int arrays.
* :class:`LazyFederatedDataset` (a :class:`~fmtl_flower.data.dataset.MultiTaskDataset`) and
  :class:`LazySparseFederatedDataset` (a
  :class:`~fmtl_flower.data.sparse_federated.SparseFederatedDataset`) hold a
  :class:`LazyTasks`; they have the same attributes and methods (``name``, ``tasks``,
  ``num_tasks``, ``dim``, ``n_train``, ``n_test``, ``task(t)``, ``pooled_train()``,
  ``pooled_test()``; ``iid``, ``params``, ``nbytes`` for the sparse one) and ``lazy = True``.
  Whatever needs all tasks (``pooled_train()``, ``list(dataset.tasks)``) still works, by
  generating them (streaming, each once): it then holds what the caller keeps.
* Skew (``load_dataset(..., skew=ratio)``) stays lazy: it needs every task's training size
  (one streaming pass, on first use) but only task ``t`` to subsample task ``t``
  (:class:`SkewSource`, bit-identical to :func:`~fmtl_flower.data.skew.skew_dataset`).
  Calling :func:`~fmtl_flower.data.skew.skew_dataset` on a lazy dataset directly works but
  builds an eager dataset (all tasks in memory).

When :func:`~fmtl_flower.data.registry.load_dataset` is lazy (:func:`use_lazy`): with
``lazy=None`` (the default) ``"synthetic"`` is lazy above :data:`LAZY_SYNTHETIC_ABOVE` (2,000)
tasks and non-IID ``"sparse-federated"`` above :data:`LAZY_SPARSE_ABOVE` (10,000) nodes;
``lazy=True`` / ``False`` forces it. Small federations stay eager because callers that sweep
all tasks repeatedly (the centralised baselines, ``fsvrg-fig2``'s full gradient every round)
would regenerate them on every sweep; a lazy task costs a regeneration (``"synthetic"``, d = 20,
20 samples: about 0.3 ms) whenever it is not in the cache. The IID ``"sparse-federated"`` is
never lazy: its reshuffle is one permutation of all the pooled rows.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np

from fmtl_flower.data.dataset import MultiTaskDataset, TaskData, _freeze_task
from fmtl_flower.data.skew import _skew_task, check_skew_ratio, skew_sizes
from fmtl_flower.data.sparse_federated import (
    SparseFederatedDataset,
    sparse_task_source,
)
from fmtl_flower.data.split import _check_seed, _check_test_frac, split_task
from fmtl_flower.data.synthetic import SyntheticSource

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "LAZY_SPARSE_ABOVE",
    "LAZY_SYNTHETIC_ABOVE",
    "LazyFederatedDataset",
    "LazySparseFederatedDataset",
    "LazyTasks",
    "SkewSource",
    "SplitSource",
    "lazy_sparse_federated",
    "lazy_synthetic",
    "use_lazy",
]

#: ``"synthetic"`` is lazy when ``num_tasks`` is above this (with ``lazy=None``). Eager, 2,000
#: tasks of the default size (d = 20, 60 samples) hold about 25 MB.
LAZY_SYNTHETIC_ABOVE = 2_000

#: Non-IID ``"sparse-federated"`` is lazy when ``num_tasks`` (K) is above this (with
#: ``lazy=None``). Eager, K = 10,000 (the paper's federation, ``simulations/fsvrg_scale.py``)
#: holds about 250 MB, and ``fsvrg-fig2`` sweeps all nodes every round.
LAZY_SPARSE_ABOVE = 10_000

#: How many generated tasks a :class:`LazyTasks` keeps (least recently used evicted).
DEFAULT_CACHE_SIZE = 64


def use_lazy(dataset: str, num_tasks: int, lazy: bool | None = None, *, iid: bool = False) -> bool:
    """Whether :func:`~fmtl_flower.data.registry.load_dataset` builds ``dataset`` lazily.

    Parameters
    ----------
    dataset : str
        ``"synthetic"`` or ``"sparse-federated"`` (any other name is never lazy).
    num_tasks : int
        Number of tasks (nodes).
    lazy : bool, optional
        Forced choice; None (default): above :data:`LAZY_SYNTHETIC_ABOVE` /
        :data:`LAZY_SPARSE_ABOVE` tasks.
    iid : bool, default False
        For ``"sparse-federated"``: the IID reshuffle is never lazy.

    Returns
    -------
    bool

    Raises
    ------
    ValueError
        ``lazy=True`` for a dataset that cannot be lazy (the message says why).
    """
    if lazy is not None and not isinstance(lazy, bool | np.bool_):
        raise ValueError(f"lazy must be a bool or None, got {lazy!r}")
    if dataset == "synthetic":
        threshold = LAZY_SYNTHETIC_ABOVE
    elif dataset == "sparse-federated" and not iid:
        threshold = LAZY_SPARSE_ABOVE
    else:
        if lazy:
            why = (
                "its IID reshuffle is one permutation of all the pooled rows, so no node can "
                "be built alone"
                if dataset == "sparse-federated"
                else "only the generated 'synthetic' and non-IID 'sparse-federated' datasets "
                "can be generated task by task"
            )
            raise ValueError(f"lazy=True is not possible for {dataset!r}: {why}")
        return False
    return bool(lazy) if lazy is not None else num_tasks > threshold


def _count_sizes(tasks: Iterable[Any], num_tasks: int) -> tuple[np.ndarray, np.ndarray]:
    """``(n_train, n_test)`` of the ``num_tasks`` tasks of ``tasks``, one pass (streaming)."""
    n_train = np.empty(num_tasks, dtype=np.int64)
    n_test = np.empty(num_tasks, dtype=np.int64)
    for t, task in enumerate(tasks):
        n_train[t], n_test[t] = task.n_train, task.n_test
    return n_train, n_test


class LazyTasks(Sequence):
    """The tasks of a lazy dataset: ``tasks[t]`` generates task ``t`` with ``source(t)``.

    Parameters
    ----------
    source : callable
        ``source(t) -> TaskData`` (or ``SparseTaskData``) for ``0 <= t < num_tasks``; a
        deterministic function of ``t``. If it has a ``sizes()`` method, that gives
        ``(n_train, n_test)`` instead of a pass over the tasks.
    num_tasks : int
        Number of tasks (>= 1).
    dim : int
        Number of features of every task (checked on each generated task).
    cache_size : int, default :data:`DEFAULT_CACHE_SIZE`
        How many accessed tasks to keep (LRU); 0 keeps none.

    Notes
    -----
    Indexing accepts ints (negative ones count from the end, as for a tuple) and slices (a
    tuple of the generated tasks). Iteration streams: it generates the tasks one at a time,
    reusing cached ones without adding to the cache. Every generated array is read-only.
    Thread-safe (a task may be generated twice by concurrent first accesses; both copies are
    equal). Picklable (the cache is not pickled).
    """

    def __init__(
        self,
        source: Callable[[int], Any],
        num_tasks: int,
        *,
        dim: int,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if isinstance(num_tasks, bool) or not isinstance(num_tasks, int | np.integer):
            raise TypeError(f"num_tasks must be an int, got {type(num_tasks).__name__}")
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 0:
            raise ValueError(f"cache_size must be an int >= 0, got {cache_size!r}")
        self.source = source
        self.num_tasks = int(num_tasks)
        self.dim = int(dim)
        self.cache_size = cache_size
        self._init_state()

    def _init_state(self) -> None:
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, Any] = OrderedDict()
        self._sizes: tuple[np.ndarray, np.ndarray] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "num_tasks": self.num_tasks,
            "dim": self.dim,
            "cache_size": self.cache_size,
            "sizes": self._sizes,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.source = state["source"]
        self.num_tasks = state["num_tasks"]
        self.dim = state["dim"]
        self.cache_size = state["cache_size"]
        self._init_state()
        self._sizes = state["sizes"]

    def __len__(self) -> int:
        return self.num_tasks

    def __repr__(self) -> str:
        return (
            f"LazyTasks(num_tasks={self.num_tasks}, dim={self.dim}, "
            f"cached={len(self._cache)}/{self.cache_size})"
        )

    def _index(self, t: Any) -> int:
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise TypeError(f"task indices must be integers or slices, not {type(t).__name__}")
        i = int(t)
        if i < 0:
            i += self.num_tasks
        if not 0 <= i < self.num_tasks:
            raise IndexError(f"task index {int(t)} out of range ({self.num_tasks} tasks)")
        return i

    def _generate(self, t: int) -> Any:
        task = self.source(t)
        if task.dim != self.dim:
            raise ValueError(f"task {t} has {task.dim} features, expected {self.dim}")
        return _freeze_task(task)

    def _lookup(self, t: int, *, keep: bool) -> Any:
        with self._lock:
            task = self._cache.get(t)
            if task is not None:
                self._cache.move_to_end(t)
                return task
        task = self._generate(t)
        if keep and self.cache_size:
            with self._lock:
                task = self._cache.setdefault(t, task)
                self._cache.move_to_end(t)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return task

    def __getitem__(self, t: Any) -> Any:
        if isinstance(t, slice):
            return tuple(self._lookup(i, keep=True) for i in range(*t.indices(self.num_tasks)))
        return self._lookup(self._index(t), keep=True)

    def __iter__(self) -> Iterator[Any]:
        for t in range(self.num_tasks):
            yield self._lookup(t, keep=False)

    def cached(self) -> list[int]:
        """Ids of the tasks in the cache, least recently used first."""
        with self._lock:
            return list(self._cache)

    def clear_cache(self) -> None:
        """Drop the cached tasks (not the cached sizes)."""
        with self._lock:
            self._cache.clear()

    def sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """``(n_train, n_test)``: read-only int64 arrays of shape ``(num_tasks,)``.

        Computed once (by the source's ``sizes()`` if it has one, else by one streaming pass
        over the tasks) and kept.
        """
        sizes = self._sizes
        if sizes is None:
            source_sizes = getattr(self.source, "sizes", None)
            if callable(source_sizes):
                n_train, n_test = source_sizes()
            else:
                n_train, n_test = _count_sizes(self, self.num_tasks)
            n_train = np.array(n_train, dtype=np.int64)
            n_test = np.array(n_test, dtype=np.int64)
            n_train.setflags(write=False)
            n_test.setflags(write=False)
            sizes = self._sizes = (n_train, n_test)
        return sizes


class _LazyDataset:
    """What the lazy containers add to the eager ones (see the module docstring)."""

    lazy: ClassVar[bool] = True
    name: str
    tasks: Any

    def __post_init__(self) -> None:
        if not isinstance(self.tasks, LazyTasks):
            raise TypeError(
                f"dataset {self.name!r}: a lazy dataset needs LazyTasks, got "
                f"{type(self.tasks).__name__}"
            )

    @property
    def dim(self) -> int:
        """Common number of features ``d`` (no task is generated)."""
        return self.tasks.dim

    @property
    def n_train(self) -> np.ndarray:
        """Per-task training sample counts, a fresh int64 array ``(num_tasks,)``; the first
        call streams through the tasks once."""
        return self.tasks.sizes()[0].copy()

    @property
    def n_test(self) -> np.ndarray:
        """Per-task test sample counts, a fresh int64 array ``(num_tasks,)``."""
        return self.tasks.sizes()[1].copy()


class LazyFederatedDataset(_LazyDataset, MultiTaskDataset):
    """A :class:`~fmtl_flower.data.dataset.MultiTaskDataset` whose ``tasks`` is a
    :class:`LazyTasks` (build one with :func:`lazy_synthetic`).

    Parameters
    ----------
    name : str
        Dataset name.
    tasks : LazyTasks
        Generates :class:`~fmtl_flower.data.dataset.TaskData`.
    """


class LazySparseFederatedDataset(_LazyDataset, SparseFederatedDataset):
    """A :class:`~fmtl_flower.data.sparse_federated.SparseFederatedDataset` whose ``tasks``
    is a :class:`LazyTasks` (non-IID only; build one with :func:`lazy_sparse_federated`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.iid:
            raise ValueError(f"dataset {self.name!r}: the IID reshuffle cannot be lazy")


class SplitSource:
    """``source(t)``: raw task ``t`` of ``raw`` split as
    :func:`~fmtl_flower.data.split.split_tasks` splits it
    (:func:`~fmtl_flower.data.split.split_task`).

    Parameters
    ----------
    raw : callable
        ``raw(t) -> (X_t, y_t)``, with attributes ``num_tasks`` and ``dim`` (e.g. a
        :class:`~fmtl_flower.data.synthetic.SyntheticSource`).
    test_frac : float
        Per-class test fraction in [0, 1).
    seed : int
        Run seed of the split.
    name : str
        Dataset name (error messages).
    """

    def __init__(self, raw: Any, test_frac: float, seed: int, name: str) -> None:
        self.raw = raw
        self.test_frac = _check_test_frac(test_frac)
        self.seed = _check_seed(seed)
        self.name = name
        self.num_tasks = int(raw.num_tasks)
        self.dim = int(raw.dim)

    def __call__(self, t: int) -> TaskData:
        X, y = self.raw(t)
        return split_task(X, y, self.test_frac, self.seed, t, self.name)


class SkewSource:
    """``source(t)``: task ``t`` of ``base`` with its training part skewed exactly as
    :func:`~fmtl_flower.data.skew.skew_dataset` skews it.

    The target sizes (:func:`~fmtl_flower.data.skew.skew_sizes`) need every task's training
    size: they are computed on first use by one streaming pass over ``base`` (flat memory) and
    kept; task ``t`` then keeps the samples drawn from ``default_rng([seed, t, 61])``.

    Parameters
    ----------
    base : callable
        ``base(t) -> TaskData``, with attributes ``num_tasks`` and ``dim``.
    ratio : float
        Skew ratio (>= 1).
    seed : int
        Run seed of the skew.
    min_size : int, default 2
        As for :func:`~fmtl_flower.data.skew.skew_sizes`.
    """

    def __init__(self, base: Any, ratio: float, seed: int, min_size: int = 2) -> None:
        self.base = base
        self.ratio = check_skew_ratio(ratio)
        self.seed = _check_seed(seed)
        self.min_size = min_size
        self.num_tasks = int(base.num_tasks)
        self.dim = int(base.dim)
        self._lock = threading.Lock()
        self._sizes: tuple[np.ndarray, np.ndarray] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """``(n_train, n_test)`` after the skew (the targets, and the base's test sizes)."""
        with self._lock:
            if self._sizes is None:
                n, n_test = _count_sizes(map(self.base, range(self.num_tasks)), self.num_tasks)
                targets = skew_sizes(n, ratio=self.ratio, seed=self.seed, min_size=self.min_size)
                self._sizes = (targets, n_test)
            return self._sizes

    def __call__(self, t: int) -> TaskData:
        targets = self.sizes()[0]
        task = self.base(t)
        X_train, y_train = _skew_task(task.X_train, task.y_train, targets[t], self.seed, t)
        return TaskData(X_train=X_train, y_train=y_train, X_test=task.X_test, y_test=task.y_test)


def lazy_synthetic(
    source: SyntheticSource,
    *,
    test_frac: float = 0.25,
    seed: int = 0,
    name: str = "synthetic",
    skew: float | None = None,
    cache_size: int = DEFAULT_CACHE_SIZE,
) -> LazyFederatedDataset:
    """The lazy counterpart of ``load_dataset("synthetic", ...)``.

    Parameters
    ----------
    source : SyntheticSource
        From :func:`~fmtl_flower.data.synthetic.synthetic_source` (the generator's arguments).
    test_frac, seed
        As for :func:`~fmtl_flower.data.split.split_tasks` (``seed`` also drives the skew).
    name : str, default "synthetic"
    skew : float, optional
        Skew ratio, as in :func:`~fmtl_flower.data.registry.load_dataset`.
    cache_size : int, default :data:`DEFAULT_CACHE_SIZE`

    Returns
    -------
    LazyFederatedDataset
        Task ``t`` bit-identical to task ``t`` of the eager dataset (read-only arrays).
    """
    task_source: Any = SplitSource(source, test_frac, seed, name)
    if skew is not None:
        task_source = SkewSource(task_source, skew, seed)
    tasks = LazyTasks(task_source, source.num_tasks, dim=source.dim, cache_size=cache_size)
    return LazyFederatedDataset(name, tasks)


def lazy_sparse_federated(
    num_tasks: int = 1000,
    *,
    dim: int = 20_000,
    seed: int = 0,
    test_frac: float = 0.25,
    name: str = "sparse-federated",
    cache_size: int = DEFAULT_CACHE_SIZE,
    **params: Any,
) -> LazySparseFederatedDataset:
    """The lazy counterpart of ``make_sparse_federated(..., iid=False)``.

    Parameters
    ----------
    num_tasks, dim, seed, test_frac, name, **params
        As for :func:`~fmtl_flower.data.sparse_federated.make_sparse_federated`.
    cache_size : int, default :data:`DEFAULT_CACHE_SIZE`

    Returns
    -------
    LazySparseFederatedDataset
        Node ``t`` bit-identical to node ``t`` of the eager dataset (read-only arrays); the
        same ``params`` record.
    """
    source = sparse_task_source(num_tasks, dim=dim, seed=seed, test_frac=test_frac, **params)
    tasks = LazyTasks(source, source.num_tasks, dim=source.dim, cache_size=cache_size)
    return LazySparseFederatedDataset(name, tasks, False, source.record())
