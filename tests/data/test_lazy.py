"""Lazy generated datasets (fmtl_flower.data.lazy): task t on demand, bit-identical to eager."""

from __future__ import annotations

import pickle
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp

from fmtl_flower.data import (
    MultiTaskDataset,
    SparseFederatedDataset,
    load_dataset,
    load_dataset_cached,
    make_sparse_federated,
    make_synthetic_tasks,
    skew_dataset,
)
from fmtl_flower.data import lazy as lazy_mod
from fmtl_flower.data.lazy import (
    DEFAULT_CACHE_SIZE,
    LazyFederatedDataset,
    LazySparseFederatedDataset,
    LazyTasks,
    SplitSource,
    lazy_sparse_federated,
    lazy_synthetic,
    use_lazy,
)
from fmtl_flower.data.synthetic import synthetic_source

SMALL = {"num_tasks": 50, "dim": 6, "samples_per_task": 16}


def assert_same_array(a: Any, b: Any) -> None:
    """Bit-identical: type, dtype, shape and bytes (CSR: its three arrays)."""
    assert type(a) is type(b)
    if sp.issparse(a):
        assert a.shape == b.shape
        for x, z in ((a.data, b.data), (a.indices, b.indices), (a.indptr, b.indptr)):
            assert x.dtype == z.dtype and x.shape == z.shape and x.tobytes() == z.tobytes()
    else:
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_same_task(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    for x, z in zip(a.arrays(), b.arrays(), strict=True):
        assert_same_array(x, z)


def assert_read_only(task: Any) -> None:
    for arr in task.arrays():
        parts = (arr.data, arr.indices, arr.indptr) if sp.issparse(arr) else (arr,)
        assert all(not p.flags.writeable for p in parts)


# -------------------------------------------------------------------------------------------
# synthetic: bit-identical to the eager dataset


@pytest.mark.parametrize(
    "extra", [{}, {"skew": 100.0}, {"test_frac": 0.0}, {"seed": 3, "test_frac": 0.5}]
)
def test_small_lazy_equals_eager_everywhere(extra: dict[str, Any]) -> None:
    eager = load_dataset("synthetic", **SMALL, **extra, lazy=False)
    lazy = load_dataset("synthetic", **SMALL, **extra, lazy=True)
    assert type(eager) is MultiTaskDataset and not eager.lazy
    assert isinstance(lazy, LazyFederatedDataset) and isinstance(lazy, MultiTaskDataset)
    assert lazy.lazy and isinstance(lazy.tasks, LazyTasks)
    assert (lazy.name, lazy.num_tasks, lazy.dim) == (eager.name, eager.num_tasks, eager.dim)
    assert len(lazy.tasks) == len(eager.tasks)
    for t in range(eager.num_tasks):  # by task(t), by index, by iteration
        assert_same_task(lazy.task(t), eager.task(t))
        assert_same_task(lazy.tasks[t], eager.tasks[t])
    for a, b in zip(lazy.tasks, eager.tasks, strict=True):
        assert_same_task(a, b)
    for a, b in ((lazy.n_train, eager.n_train), (lazy.n_test, eager.n_test)):
        assert_same_array(a, b)
    for a, b in zip(
        lazy.pooled_train() + lazy.pooled_test(),
        eager.pooled_train() + eager.pooled_test(),
        strict=True,
    ):
        assert_same_array(a, b)


def test_large_federation_is_lazy_by_default_and_matches_eager() -> None:
    args = {"num_tasks": 5000, "dim": 4, "samples_per_task": 12, "seed": 5}
    lazy = load_dataset("synthetic", **args)
    assert lazy.num_tasks > lazy_mod.LAZY_SYNTHETIC_ABOVE and lazy.lazy
    assert lazy.tasks.cached() == []  # nothing generated yet
    assert lazy.dim == 4 and lazy.tasks.cached() == []
    eager = load_dataset("synthetic", **args, lazy=False)
    sample = [0, 1, 2, 4999, 2500, *np.random.default_rng(0).integers(0, 5000, 20).tolist()]
    for t in sample:
        assert_same_task(lazy.task(t), eager.task(t))
    assert_same_task(lazy.tasks[-1], eager.tasks[4999])
    assert_same_array(lazy.n_train, eager.n_train)
    assert_same_array(lazy.n_test, eager.n_test)
    assert len(lazy.tasks.cached()) <= DEFAULT_CACHE_SIZE


def test_source_is_the_eager_generator() -> None:
    source = synthetic_source(7, dim=3, samples_per_task=10, seed=2)
    Xs, ys = make_synthetic_tasks(7, dim=3, samples_per_task=10, seed=2)
    for t in range(7):
        X, y = source(t)
        assert_same_array(X, Xs[t])
        assert_same_array(y, ys[t])
    with pytest.raises(IndexError):
        source(7)


def test_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    assert lazy_mod.LAZY_SYNTHETIC_ABOVE == 2000 and lazy_mod.LAZY_SPARSE_ABOVE == 10_000
    assert not use_lazy("synthetic", 2000) and use_lazy("synthetic", 2001)
    assert use_lazy("synthetic", 3, True) and not use_lazy("synthetic", 10**6, False)
    assert not use_lazy("sparse-federated", 10_000) and use_lazy("sparse-federated", 10_001)
    assert not use_lazy("sparse-federated", 10**6, iid=True)
    assert not use_lazy("small", 10**6)
    monkeypatch.setattr(lazy_mod, "LAZY_SYNTHETIC_ABOVE", 10)
    assert not load_dataset(num_tasks=10, dim=2).lazy
    assert load_dataset(num_tasks=11, dim=2).lazy
    assert load_dataset().lazy  # the default 30 tasks, above the patched threshold
    monkeypatch.undo()
    assert not load_dataset().lazy


# -------------------------------------------------------------------------------------------
# the LazyTasks sequence


def test_lazy_tasks_are_read_only_cached_or_not() -> None:
    lazy = load_dataset(**SMALL, lazy=True)
    for task in (lazy.task(0), lazy.tasks[1], next(iter(lazy.tasks))):
        assert_read_only(task)
    with pytest.raises(ValueError, match="read-only"):
        lazy.task(0).X_train[0, 0] = 1.0
    cached = load_dataset_cached(**SMALL, lazy=True)
    assert cached.lazy and cached.tasks.cached() == []  # freezing generated nothing
    assert_read_only(cached.task(3))
    skewed = load_dataset(**SMALL, skew=10, lazy=True)
    assert_read_only(skewed.task(2))


def test_lru_cache_is_bounded_and_iteration_streams() -> None:
    lazy = load_dataset(**SMALL, lazy=True)
    assert lazy.task(5) is lazy.task(5) is lazy.tasks[5]  # cached
    for t in range(lazy.num_tasks):
        lazy.task(t)
    assert lazy.tasks.cached() == list(range(lazy.num_tasks))  # 50 <= 64
    small = lazy_synthetic(synthetic_source(**SMALL), cache_size=4)
    for t in (0, 1, 2, 3, 0, 4):
        small.task(t)
    assert small.tasks.cached() == [2, 3, 0, 4]  # 1 was least recently used
    small.tasks.clear_cache()
    assert list(small.tasks) and small.tasks.cached() == []  # iteration does not cache
    none = lazy_synthetic(synthetic_source(**SMALL), cache_size=0)
    assert none.task(1) is not none.task(1) and none.tasks.cached() == []
    assert_same_task(none.task(1), lazy.task(1))


def test_sequence_protocol() -> None:
    lazy = load_dataset(**SMALL, lazy=True)
    tasks = lazy.tasks
    assert len(tasks) == 50 and "LazyTasks(num_tasks=50" in repr(lazy)
    assert_same_task(tasks[-50], tasks[0])
    assert_same_task(tasks[np.int64(7)], lazy.task(np.int64(7)))
    part = tasks[2:8:3]
    assert isinstance(part, tuple) and len(part) == 2
    assert_same_task(part[1], tasks[5])
    with pytest.raises(IndexError):
        tasks[50]
    with pytest.raises(IndexError):
        tasks[-51]
    with pytest.raises(TypeError):
        tasks[1.0]  # type: ignore[index]
    with pytest.raises(IndexError, match="out of range"):
        lazy.task(-1)  # task() takes ids, not Python indices (as for the eager dataset)
    with pytest.raises(TypeError):
        lazy.task(True)  # type: ignore[arg-type]


def test_sizes_stream_once_and_return_fresh_arrays() -> None:
    source = SplitSource(synthetic_source(**SMALL), 0.25, 0, "synthetic")
    calls: list[int] = []

    def counting(t: int) -> Any:
        calls.append(t)
        return source(t)

    dataset = LazyFederatedDataset("synthetic", LazyTasks(counting, 50, dim=6))
    n = dataset.n_train
    assert calls == list(range(50))
    n[0] = -1  # a fresh, writable copy
    assert dataset.n_train[0] != -1 and dataset.n_test.sum() > 0
    assert len(calls) == 50  # cached: no second pass
    eager = load_dataset(**SMALL)
    assert_same_array(dataset.n_train, eager.n_train)


def test_memory_is_flat_in_num_tasks() -> None:
    lazy = load_dataset(num_tasks=3000, dim=20, samples_per_task=20)
    assert lazy.lazy
    tracemalloc.start()
    try:
        total = int(lazy.n_train.sum())
        for t in range(0, 3000, 7):
            lazy.task(t)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # eager, the 3000 tasks hold ~ total * (20 + 1) * 8 bytes (> 8 MB); lazily: the two size
    # arrays (48 KB) and at most 64 tasks (~ 0.3 MB)
    assert total * 21 * 8 > 8e6
    assert peak < 2e6, peak
    assert len(lazy.tasks.cached()) == DEFAULT_CACHE_SIZE


def test_pickle_and_threads() -> None:
    lazy = load_dataset(**SMALL, skew=20.0, lazy=True)
    lazy.task(3)
    n = lazy.n_train
    back = pickle.loads(pickle.dumps(lazy))
    assert isinstance(back, LazyFederatedDataset) and back.tasks.cached() == []
    assert_same_array(back.n_train, n)
    assert_same_task(back.task(3), lazy.task(3))
    fresh = load_dataset(**SMALL, skew=20.0, lazy=True)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(fresh.task, [t % 50 for t in range(200)]))
    for t, task in enumerate(got):
        assert_same_task(task, lazy.task(t % 50))


# -------------------------------------------------------------------------------------------
# skew, cache, errors


def test_skew_is_lazy_and_skew_dataset_on_a_lazy_dataset_is_eager() -> None:
    plain = load_dataset(**SMALL, lazy=True)
    skewed = load_dataset(**SMALL, skew=100.0, lazy=True)
    assert skewed.tasks.source._sizes is None  # no pass until a task or the sizes are needed
    eager = skew_dataset(plain, ratio=100.0, seed=0)  # builds all tasks
    assert type(eager) is MultiTaskDataset
    for t in range(plain.num_tasks):
        assert_same_task(skewed.task(t), eager.task(t))
        assert_same_array(skewed.task(t).X_test, plain.task(t).X_test)
    assert skewed.n_train.max() / skewed.n_train.min() > 20


def test_cache_keys_and_lazy_objects() -> None:
    a = load_dataset_cached(num_tasks=2500, dim=3, samples_per_task=12)
    assert a.lazy and a.tasks.cached() == [] and a.tasks._sizes is None
    assert load_dataset_cached(num_tasks=2500, dim=3, samples_per_task=12, lazy=True) is a
    small = load_dataset_cached(num_tasks=3)
    assert load_dataset_cached(num_tasks=3, lazy=False) is small and not small.lazy
    forced = load_dataset_cached(num_tasks=3, lazy=True)
    assert forced is not small and forced.lazy
    for t in range(3):
        assert_same_task(forced.task(t), small.task(t))


@pytest.mark.parametrize(
    ("name", "kwargs", "pattern"),
    [
        ("fedem-synthetic", {"num_tasks": 4, "n_test": 5}, "not possible for 'fedem-synthetic'"),
        ("small", {}, "not possible for 'small'"),
        ("sparse-federated", {"num_tasks": 3, "dim": 400, "iid": True}, "IID reshuffle"),
    ],
)
def test_lazy_true_is_refused_where_impossible(
    name: str, kwargs: dict[str, Any], pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        load_dataset(name, lazy=True, **kwargs)
    with pytest.raises(ValueError, match=pattern):
        load_dataset_cached(name, lazy=True, **kwargs)


def test_bad_lazy_value() -> None:
    with pytest.raises(ValueError, match="lazy must be a bool"):
        load_dataset(num_tasks=3, lazy="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lazy must be a bool"):
        load_dataset_cached(num_tasks=3, lazy=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_tasks"):
        load_dataset_cached(num_tasks=0, lazy=True)
    with pytest.raises(TypeError, match="LazyTasks"):
        LazyFederatedDataset("x", ())  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------
# sparse-federated (non-IID): per-node seeded, so lazy too


def test_sparse_lazy_equals_eager() -> None:
    eager = make_sparse_federated(30, dim=600, seed=1)
    lazy = load_dataset("sparse-federated", num_tasks=30, dim=600, seed=1, lazy=True)
    assert isinstance(lazy, LazySparseFederatedDataset) and isinstance(
        lazy, SparseFederatedDataset
    )
    assert lazy.lazy and not lazy.iid and lazy.params == eager.params
    assert (lazy.num_tasks, lazy.dim, lazy.name) == (30, 600, "sparse-federated")
    for t in range(30):
        assert_same_task(lazy.task(t), eager.task(t))
        assert_read_only(lazy.task(t))
    assert_same_array(lazy.n_train, eager.n_train)
    assert_same_array(lazy.n_test, eager.n_test)
    assert lazy.nbytes == eager.nbytes
    for a, b in zip(lazy.pooled_train() + lazy.pooled_test(),
                    eager.pooled_train() + eager.pooled_test(), strict=True):
        assert_same_array(a, b)
    direct = lazy_sparse_federated(30, dim=600, seed=1)
    assert_same_task(direct.task(29), eager.task(29))


def test_sparse_threshold_and_iid_stays_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lazy_mod, "LAZY_SPARSE_ABOVE", 5)
    assert load_dataset("sparse-federated", num_tasks=6, dim=400).lazy
    assert not load_dataset("sparse-federated", num_tasks=5, dim=400).lazy
    iid = load_dataset("sparse-federated", num_tasks=6, dim=400, iid=True)
    assert not iid.lazy and iid.iid
    cached = load_dataset_cached("sparse-federated", num_tasks=6, dim=400)
    assert cached.lazy and cached.tasks.cached() == []
    with pytest.raises(ValueError, match="IID reshuffle cannot be lazy"):
        LazySparseFederatedDataset("x", cached.tasks, True)
