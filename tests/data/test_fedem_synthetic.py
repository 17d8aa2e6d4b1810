"""Tests for fmtl_flower.data.fedem_synthetic and the ``"fedem-synthetic"`` registry entry."""

# The reference implementation below deliberately uses numpy's legacy global RNG, as the
# authors' script does: that is what the generator must reproduce.
# ruff: noqa: NPY002

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import FrozenInstanceError
from typing import Any

import numpy as np
import pytest
import sklearn.utils

from fmtl_flower.data import (
    FEDEM_GENERATORS,
    FEDEM_SYNTHETIC,
    FEDEM_SYNTHETIC_SEED,
    FedEMSynthetic,
    FedEMSyntheticSample,
    available_datasets,
    iter_fedem_synthetic,
    load_dataset,
    load_dataset_cached,
    make_fedem_synthetic,
    registry,
)

#: The paper's training-set sizes (reference_algorithms.md, section 8.6).
PAPER_FIRST_SIZES = [86, 192, 69, 67, 1000, 936, 115, 145, 304, 710]


@pytest.fixture
def global_rng() -> Iterator[None]:
    """Restore numpy's legacy global random state after a test that seeds it."""
    state = np.random.get_state()
    yield
    np.random.set_state(state)


def _reference(
    num_tasks: int,
    n_test: int | None,
    *,
    fixed: bool,
    num_components: int = 3,
    dim: int = 150,
    noise_level: float = 0.1,
    alpha: float = 0.4,
    seed: int = 12345,
) -> tuple[list[int], np.ndarray, np.ndarray, Iterator[tuple[np.ndarray, ...]]]:
    """The authors' generator, written the straightforward way with the global RNG.

    Returns the sizes, mixture weights, components and a lazy iterator over the tasks'
    ``(X_train, y_train, X_test, y_test)``; if ``n_test`` is None (the train-only stream),
    ``(X_train, y_train, train_counts)`` instead. ``np.random`` must not be used elsewhere
    while iterating.
    """
    np.random.seed(seed)
    sizes = [min(s + 50, 1000) for s in np.random.lognormal(4, 2, num_tasks).astype(int)]
    weights = np.zeros((num_tasks, num_components))
    for t in range(num_tasks):
        weights[t] = np.random.dirichlet(alpha=alpha * np.ones(num_components))
    theta = np.random.uniform(-1.0, 1.0, size=(num_components, dim))

    def sample(t: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        count = np.random.multinomial(n, weights[t])
        y = np.zeros(n)
        x = np.random.uniform(-1.0, 1.0, size=(n, dim))
        r = 0
        for k in range(num_components):
            y_hat = x[r : r + count[k]] @ theta[k]
            noise = np.random.normal(size=count[k], scale=noise_level)
            y[r : r + count[k]] = np.round(1 / (1 + np.exp(-(y_hat + noise)))).astype(int)
            if fixed:
                r += count[k]
        x, y = sklearn.utils.shuffle(x, y)
        return x, y, count

    def tasks() -> Iterator[tuple[np.ndarray, ...]]:
        for t in range(num_tasks):
            x, y, count = sample(t, sizes[t])
            if n_test is None:
                yield x, y, count
            else:
                x_test, y_test, _ = sample(t, n_test)
                yield x, y, x_test, y_test

    return sizes, weights, theta, tasks()


def _arrays(task: Any) -> tuple[np.ndarray, ...]:
    return task.train.X, task.train.y, task.test.X, task.test.y


def _assert_same(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y, strict=True)


def _blocks(counts: np.ndarray, n: int, generator: str) -> np.ndarray:
    """Component whose label each unshuffled row holds (-1: forced 0 by the released bug)."""
    owner = np.full(n, -1)
    start = 0
    for k, c in enumerate(counts):
        owner[start : start + c] = k  # later components overwrite earlier ones
        if generator == "fixed":
            start += c
    return owner


# --------------------------------------------------------------------------------------------
# bit-exact reproduction


def test_index_shuffle_is_sklearn_shuffle(global_rng: None) -> None:
    """``arange`` + in-place shuffle + take rows is what ``sklearn.utils.shuffle`` does."""
    for n in (1, 2, 7, 50, 1000):
        x = np.random.default_rng(n).uniform(size=(n, 3))
        y = np.arange(n, dtype=np.float64)
        np.random.seed(n)
        x_ref, y_ref = sklearn.utils.shuffle(x, y)
        after_ref = np.random.get_state()
        rng = np.random.RandomState(n)
        idx = np.arange(n)
        rng.shuffle(idx)
        _assert_same((x_ref, y_ref), (x[idx], y[idx]))
        # same numbers consumed, so the stream continues identically
        state = rng.get_state()
        assert all(np.array_equal(a, b) for a, b in zip(after_ref, state, strict=True))


@pytest.mark.parametrize("generator", FEDEM_GENERATORS)
def test_bit_exact_first_tasks_of_paper_stream(generator: str, global_rng: None) -> None:
    stream = iter_fedem_synthetic(300, n_test=50, generator=generator)
    sizes, weights, theta, ref_tasks = _reference(300, 50, fixed=generator == "fixed")
    np.testing.assert_array_equal(stream.train_sizes, sizes, strict=False)
    assert stream.train_sizes.dtype == np.int64
    _assert_same((stream.mixture_weights, stream.components), (weights, theta))
    for t in range(5):
        task = next(stream.tasks)
        assert task.task == t
        _assert_same(_arrays(task), next(ref_tasks))


@pytest.mark.parametrize("generator", FEDEM_GENERATORS)
def test_bit_exact_other_arguments(generator: str, global_rng: None) -> None:
    kwargs: dict[str, Any] = {
        "num_components": 4,
        "dim": 7,
        "noise_level": 0.5,
        "alpha": 1.3,
        "seed": 7,
    }
    data = make_fedem_synthetic(12, n_test=30, generator=generator, **kwargs)
    sizes, weights, theta, ref_tasks = _reference(12, 30, fixed=generator == "fixed", **kwargs)
    np.testing.assert_array_equal(data.train_sizes, sizes, strict=False)
    _assert_same((data.mixture_weights, data.components), (weights, theta))
    assert len(data.tasks) == 12
    for mine, ref in zip(data.tasks, ref_tasks, strict=True):
        _assert_same(mine, ref)


@pytest.mark.slow
@pytest.mark.parametrize("generator", FEDEM_GENERATORS)
def test_bit_exact_whole_paper_dataset(generator: str, global_rng: None) -> None:
    """All 300 tasks with the paper's n_test = 5000, streamed (10-15 s per generator)."""
    stream = iter_fedem_synthetic(generator=generator)
    *_, ref_tasks = _reference(300, 5000, fixed=generator == "fixed")
    for task, ref in zip(stream.tasks, ref_tasks, strict=True):
        _assert_same(_arrays(task), ref)


# --------------------------------------------------------------------------------------------
# the paper's statistics


def test_paper_sizes_and_mixture_weights() -> None:
    stream = iter_fedem_synthetic(n_test=1)
    sizes = stream.train_sizes
    assert sizes.shape == (300,)
    assert sizes.min() == 50 and sizes.max() == 1000
    assert sizes.sum() == 67758
    assert np.count_nonzero(sizes == 1000) == 17 and np.count_nonzero(sizes == 50) == 9
    assert sizes[:10].tolist() == PAPER_FIRST_SIZES
    assert np.median(sizes) == 93 and round(float(sizes.mean()), 1) == 225.9
    top = stream.mixture_weights.max(axis=1)
    assert round(float(top.mean()), 3) == 0.734
    assert np.count_nonzero(top > 0.9) == 70  # 23.3 % of the tasks
    np.testing.assert_allclose(stream.mixture_weights.sum(axis=1), 1.0)
    assert stream.components.shape == (3, 150)
    assert np.all(np.abs(stream.components) <= 1.0)
    # the sizes do not depend on n_test, and the tasks have them
    data = make_fedem_synthetic(n_test=1)
    np.testing.assert_array_equal(data.train_sizes, sizes)
    assert all(task[2].shape == (1, 150) for task in data.tasks)


def test_released_label_fractions_with_paper_settings() -> None:
    """Forced-0 and positive fractions of the training sets, streamed task by task.

    With the paper's n_test = 5000, over the 300 training sets: forced-0 fraction
    ``1 - max_k c_k / n_t`` mean 0.266 (max 0.643), fraction of ``y = 1`` mean 0.362 (range
    0.175-0.567). The notes' figures (0.260, max 0.649; 0.368, 0.143-0.620) are those of the
    stream without the test draws, see :func:`test_notes_fractions_are_train_only_stream`.
    Only one task is held at a time (about 6 MB of test data instead of 1.8 GB).
    """
    forced = []
    positive = []
    for task in iter_fedem_synthetic(generator="released").tasks:
        assert task.test.X.shape == (5000, 150)
        train = task.train
        n = train.y.shape[0]
        owner = _blocks(train.counts, n, "released")[train.order]
        assert np.all(train.y[owner < 0] == 0.0)
        assert np.count_nonzero(owner < 0) == n - train.counts.max()
        forced.append(1.0 - train.counts.max() / n)
        positive.append(float(train.y.mean()))
    assert len(forced) == 300
    assert round(float(np.mean(forced)), 3) == 0.266
    assert round(float(np.max(forced)), 3) == 0.643
    assert round(float(np.mean(positive)), 3) == 0.362
    assert round(min(positive), 3) == 0.175 and round(max(positive), 3) == 0.567


def test_notes_fractions_are_train_only_stream(global_rng: None) -> None:
    """The notes' figures (reference_algorithms.md 8.6) are those of a train-only stream.

    Drawing the 300 training sets without the test sets in between (not what the authors'
    script does) gives exactly the published forced-0 mean 0.260 (max 0.649) and positive
    fraction 0.368 (0.143-0.620).
    """
    sizes, _, _, ref_tasks = _reference(300, None, fixed=False)
    forced = []
    positive = []
    for n, (x, y, count) in zip(sizes, ref_tasks, strict=True):
        assert x.shape == (n, 150)
        forced.append(1.0 - count.max() / n)
        positive.append(float(y.mean()))
    assert round(float(np.mean(forced)), 3) == 0.260
    assert round(float(np.max(forced)), 3) == 0.649
    assert round(float(np.mean(positive)), 3) == 0.368
    assert round(min(positive), 3) == 0.143 and round(max(positive), 3) == 0.620


# --------------------------------------------------------------------------------------------
# released vs fixed


def test_generators_share_every_draw() -> None:
    """Both generators consume the same numbers: only the labels differ."""
    released = iter_fedem_synthetic(40, n_test=60, dim=10)
    fixed = iter_fedem_synthetic(40, n_test=60, dim=10, generator="fixed")
    for arr_r, arr_f in zip(released[:3], fixed[:3], strict=True):
        np.testing.assert_array_equal(arr_r, arr_f)
    differ = 0
    for task_r, task_f in zip(released.tasks, fixed.tasks, strict=True):
        for part_r, part_f in ((task_r.train, task_f.train), (task_r.test, task_f.test)):
            np.testing.assert_array_equal(part_r.X, part_f.X)
            np.testing.assert_array_equal(part_r.counts, part_f.counts)
            np.testing.assert_array_equal(part_r.order, part_f.order)
            differ += int(np.any(part_r.y != part_f.y))
    assert differ > 0


@pytest.mark.parametrize("generator", FEDEM_GENERATORS)
def test_labels_follow_the_component_blocks_without_noise(generator: str) -> None:
    """With noise_level = 0 each label is exactly 1[x . theta_k > 0] of its row's block.

    Released: the block is that of the last component whose count exceeds the unshuffled
    row index, and rows past every count are 0. Fixed: the blocks are consecutive.
    """
    stream = iter_fedem_synthetic(30, n_test=80, dim=12, noise_level=0.0, generator=generator)
    theta = stream.components
    forced_any = False
    for task in stream.tasks:
        for part in (task.train, task.test):
            n = part.y.shape[0]
            assert sorted(part.order.tolist()) == list(range(n))
            assert part.counts.sum() == n
            owner = _blocks(part.counts, n, generator)[part.order]
            scores = np.einsum("ij,ij->i", part.X, theta[np.maximum(owner, 0)])
            expected = np.where(owner >= 0, (scores > 0).astype(np.float64), 0.0)
            np.testing.assert_array_equal(part.y, expected)
            if generator == "fixed":
                assert np.all(owner >= 0)
                # each component holds exactly its multinomial count of rows
                np.testing.assert_array_equal(
                    np.bincount(owner, minlength=theta.shape[0]), part.counts
                )
            else:
                forced_any |= bool(np.any(owner < 0))
                assert np.count_nonzero(owner < 0) == n - part.counts.max()
    assert forced_any == (generator == "released")


@pytest.mark.parametrize("generator", FEDEM_GENERATORS)
def test_labels_with_noise_follow_their_component(generator: str) -> None:
    """With the paper's noise every y = 1 row satisfies its component's rule up to the noise.

    ``y = 1`` means ``x . theta_k + eps > 0`` with ``eps ~ N(0, 0.1^2)``, so ``x . theta_k``
    is above ``-0.7`` (7 standard deviations) for the component ``k`` of the row's block,
    and nearly all labels agree with the noiseless rule (``|x . theta_k|`` is ~4 on average).
    """
    stream = iter_fedem_synthetic(30, n_test=200, generator=generator)
    theta = stream.components
    agree = total = 0
    for task in stream.tasks:
        for part in (task.train, task.test):
            owner = _blocks(part.counts, part.y.shape[0], generator)[part.order]
            assert np.all(part.y[owner < 0] == 0.0)
            inside = owner >= 0
            scores = np.einsum("ij,ij->i", part.X[inside], theta[owner[inside]])
            y = part.y[inside]
            assert np.all(scores[y == 1.0] > -0.7)
            assert np.all(scores[y == 0.0] < 0.7)
            agree += int(np.count_nonzero(y == (scores > 0)))
            total += int(y.size)
    assert agree / total > 0.97


# --------------------------------------------------------------------------------------------
# the returned objects and argument checks


def test_dataset_object() -> None:
    data = make_fedem_synthetic(6, n_test=9, dim=5, generator="fixed", seed=3)
    assert isinstance(data, FedEMSynthetic)
    assert data.num_tasks == 6 and data.num_components == 3 and data.dim == 5
    assert data.generator == "fixed" and data.seed == 3
    assert data.mixture_weights.shape == (6, 3) and data.components.shape == (3, 5)
    np.testing.assert_array_equal(data.train_sizes, [t[0].shape[0] for t in data.tasks])
    for X_train, y_train, X_test, y_test in data.tasks:
        for X, y in ((X_train, y_train), (X_test, y_test)):
            assert X.dtype == np.float64 and X.flags.c_contiguous and X.shape[1] == 5
            assert y.dtype == np.float64 and y.shape == (X.shape[0],)
            assert set(np.unique(y).tolist()) <= {0.0, 1.0}
            assert np.all((X >= -1.0) & (X < 1.0))
        assert X_test.shape[0] == 9
    with pytest.raises(FrozenInstanceError):
        data.seed = 4  # type: ignore[misc]
    again = make_fedem_synthetic(6, n_test=9, dim=5, generator="fixed", seed=3)
    for a, b in zip(data.tasks, again.tasks, strict=True):
        _assert_same(a, b)


def test_stream_is_single_pass_and_independent_of_returned_arrays() -> None:
    reference = make_fedem_synthetic(5, n_test=7, dim=4)
    stream = iter_fedem_synthetic(5, n_test=7, dim=4)
    stream.components[...] = 0.0
    stream.mixture_weights[...] = 1.0 / 3.0
    tasks = list(stream.tasks)
    assert [t.task for t in tasks] == list(range(5))
    assert isinstance(tasks[0].train, FedEMSyntheticSample)
    for mine, ref in zip(tasks, reference.tasks, strict=True):
        _assert_same(_arrays(mine), ref)
    assert list(stream.tasks) == []


def test_defaults_are_the_paper_settings() -> None:
    params = inspect.signature(make_fedem_synthetic).parameters
    defaults = {name: p.default for name, p in params.items()}
    assert defaults == {
        "num_tasks": 300,
        "num_components": 3,
        "dim": 150,
        "noise_level": 0.1,
        "n_test": 5000,
        "alpha": 0.4,
        "seed": 12345,
        "generator": "released",
    }
    assert inspect.signature(iter_fedem_synthetic).parameters == params
    assert FEDEM_SYNTHETIC_SEED == defaults["seed"]
    for key, value in registry._FEDEM_DEFAULTS.items():
        assert defaults[key] == value


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_tasks": 0}, r"num_tasks must be a positive int, got 0"),
        ({"num_tasks": True}, r"num_tasks must be a positive int"),
        ({"num_tasks": 2.0}, r"num_tasks must be a positive int"),
        ({"num_components": 0}, r"num_components must be a positive int"),
        ({"dim": -3}, r"dim must be a positive int"),
        ({"n_test": 0}, r"n_test must be a positive int"),
        ({"noise_level": -0.1}, r"noise_level must be >= 0"),
        ({"noise_level": float("nan")}, r"noise_level must be finite"),
        ({"noise_level": "0.1"}, r"noise_level must be a number"),
        ({"alpha": 0.0}, r"alpha must be > 0"),
        ({"alpha": float("inf")}, r"alpha must be finite"),
        ({"seed": -1}, r"seed must be an int in \[0, 2\*\*32 - 1\]"),
        ({"seed": 2**32}, r"seed must be an int"),
        ({"seed": 1.5}, r"seed must be an int"),
        ({"generator": "bogus"}, r"generator must be one of \['released', 'fixed'\].*'bogus'"),
        ({"generator": None}, r"generator must be one of"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        make_fedem_synthetic(**{"num_tasks": 2, "n_test": 3, **kwargs})
    with pytest.raises(ValueError, match=pattern):
        iter_fedem_synthetic(**{"num_tasks": 2, "n_test": 3, **kwargs})


def test_numpy_integer_arguments_and_zero_noise() -> None:
    a = make_fedem_synthetic(np.int64(3), n_test=np.int32(4), dim=np.int64(2), seed=np.uint32(5))
    b = make_fedem_synthetic(3, n_test=4, dim=2, seed=5)
    assert a.seed == 5 and type(a.seed) is int
    for x, y in zip(a.tasks, b.tasks, strict=True):
        _assert_same(x, y)
    make_fedem_synthetic(3, n_test=4, dim=2, noise_level=0, num_components=1)


# --------------------------------------------------------------------------------------------
# registry


def _same(a: Any, b: Any) -> bool:
    return a.num_tasks == b.num_tasks and all(
        np.array_equal(x, y)
        for ta, tb in zip(a.tasks, b.tasks, strict=True)
        for x, y in zip(ta.arrays(), tb.arrays(), strict=True)
    )


def test_registry_name() -> None:
    assert FEDEM_SYNTHETIC == "fedem-synthetic"
    assert FEDEM_SYNTHETIC in available_datasets()


def test_registry_loads_generator_output() -> None:
    ds = load_dataset("fedem-synthetic", num_tasks=10, n_test=20)
    assert ds.name == "fedem-synthetic" and ds.num_tasks == 10 and ds.dim == 150
    assert np.all(ds.n_test == 20)
    data = make_fedem_synthetic(10, n_test=20)
    np.testing.assert_array_equal(ds.n_train, data.train_sizes)
    for task, ref in zip(ds.tasks, data.tasks, strict=True):
        _assert_same(task.arrays(), ref)
        for y in (task.y_train, task.y_test):
            assert set(np.unique(y).tolist()) <= {0.0, 1.0}


def test_registry_data_ignore_run_seed_and_test_frac() -> None:
    base = load_dataset("fedem-synthetic", num_tasks=6, n_test=15)
    for kwargs in ({"seed": 3}, {"seed": 99, "test_frac": 0.0}, {"test_frac": 0.9}):
        other = load_dataset("fedem-synthetic", num_tasks=6, n_test=15, **kwargs)
        assert _same(base, other)
    # the run seed and test fraction are still validated
    with pytest.raises(ValueError, match="seed"):
        load_dataset("fedem-synthetic", num_tasks=2, n_test=5, seed=-1)
    with pytest.raises(ValueError, match="test_frac"):
        load_dataset("fedem-synthetic", num_tasks=2, n_test=5, test_frac=1.0)


def test_registry_generator_and_dim() -> None:
    released = load_dataset("fedem-synthetic", num_tasks=8, n_test=30, dim=6)
    fixed = load_dataset("fedem-synthetic", num_tasks=8, n_test=30, dim=6, generator="fixed")
    explicit = load_dataset("fedem-synthetic", num_tasks=8, n_test=30, dim=6, generator="released")
    assert released.dim == 6 and _same(released, explicit) and not _same(released, fixed)
    for a, b in zip(released.tasks, fixed.tasks, strict=True):
        np.testing.assert_array_equal(a.X_train, b.X_train)
        np.testing.assert_array_equal(a.X_test, b.X_test)
    data = make_fedem_synthetic(8, n_test=30, dim=6, generator="fixed")
    for task, ref in zip(fixed.tasks, data.tasks, strict=True):
        _assert_same(task.arrays(), ref)


@pytest.mark.parametrize(
    ("name", "kwargs", "pattern"),
    [
        ("fedem-synthetic", {"generator": "bogus"}, r"generator must be one of \['released', "),
        ("fedem-synthetic", {"generator": 1}, r"generator must be one of"),
        ("synthetic", {"generator": "fixed"}, r"generator only apply to 'fedem-synthetic', not "),
        ("synthetic", {"n_test": 10}, r"n_test only apply to 'fedem-synthetic', not to 'synth"),
        ("small", {"generator": "fixed", "n_test": 3}, r"generator, n_test only apply to 'fedem"),
        (
            "fedem-synthetic",
            {"samples_per_task": 10},
            r"samples_per_task cannot be used with 'fedem-synthetic'",
        ),
        ("fedem-synthetic", {"skew": 100}, r"skew cannot be used with 'fedem-synthetic'"),
        (
            "fedem-synthetic",
            {"skew": 10, "samples_per_task": 10},
            r"samples_per_task, skew cannot be used",
        ),
        ("fedem-synthetic", {"n_test": 0}, r"n_test must be a positive int"),
        ("fedem-synthetic", {"num_tasks": 0}, r"num_tasks must be a positive int"),
        ("fedem-synthetic", {"dim": 0}, r"dim must be a positive int"),
        ("fedem-synthetic", {"data_path": "x.mat"}, r"data_path only applies to named"),
        ("fedem-synthetic", {"download": True}, r"download=True only applies to the paper"),
    ],
)
def test_registry_errors(name: str, kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        load_dataset(name, **kwargs)
    with pytest.raises(ValueError, match=pattern):
        load_dataset_cached(name, **kwargs)


def test_registry_cache() -> None:
    a = load_dataset_cached("fedem-synthetic", num_tasks=5, n_test=12)
    for task in a.tasks:
        for arr in task.arrays():
            assert not arr.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        a.task(0).y_train[0] = 1.0
    # the data do not depend on seed / test_frac, and explicit defaults are the same data
    assert load_dataset_cached("fedem-synthetic", seed=7, num_tasks=5, n_test=12) is a
    assert load_dataset_cached("fedem-synthetic", test_frac=0.5, num_tasks=5, n_test=12) is a
    same = load_dataset_cached(
        "fedem-synthetic", num_tasks=5, n_test=12, dim=150, generator="released"
    )
    assert same is a
    assert registry._load_cached.cache_info().currsize == 1
    # every data-changing argument is part of the key
    fixed = load_dataset_cached("fedem-synthetic", num_tasks=5, n_test=12, generator="fixed")
    other_n = load_dataset_cached("fedem-synthetic", num_tasks=5, n_test=13)
    other_d = load_dataset_cached("fedem-synthetic", num_tasks=5, n_test=12, dim=3)
    other_t = load_dataset_cached("fedem-synthetic", num_tasks=4, n_test=12)
    entries = [a, fixed, other_n, other_d, other_t]
    assert len({id(e) for e in entries}) == 5
    assert not _same(a, fixed) and np.all(other_n.n_test == 13) and other_d.dim == 3
    assert other_t.num_tasks == 4
    fresh = load_dataset("fedem-synthetic", num_tasks=5, n_test=12)
    assert fresh.task(0).X_train.flags.writeable and _same(fresh, a)
