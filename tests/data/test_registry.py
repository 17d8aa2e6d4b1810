"""Tests for fmtl_flower.data.registry."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import fmtl_flower.data as data_pkg
from fmtl_flower.data import (
    NAMED_FILES,
    PAPER_DATASETS,
    MultiTaskDataset,
    available_datasets,
    clear_dataset_cache,
    default_data_dirs,
    load_dataset,
    load_dataset_cached,
    registry,
    resolve_data_file,
)

from .helpers import SHARED_DATA_DIR, MatWriter, toy_tasks

REPO_CANDIDATE = (Path(registry.__file__).resolve().parents[3] / "shared" / "data").resolve()


def _same_arrays(a: MultiTaskDataset, b: MultiTaskDataset) -> bool:
    return a.num_tasks == b.num_tasks and all(
        np.array_equal(x, y)
        for ta, tb in zip(a.tasks, b.tasks, strict=True)
        for x, y in zip(ta.arrays(), tb.arrays(), strict=True)
    )


def test_available_datasets() -> None:
    assert available_datasets() == [
        "synthetic",
        "fedem-synthetic",
        "sparse-federated",
        "digits-dirichlet",
        "small",
        "eat-voc",
        "har",
        "vehicle",
        "gleam",
    ]
    assert NAMED_FILES == {"small": "small.mat", "eat-voc": "EAT_VOC.mat"}
    assert list(PAPER_DATASETS) == ["har", "vehicle", "gleam"]


def test_repo_candidate_is_next_to_the_checkout() -> None:
    # <repo>/fmtl_flower/data/registry.py -> <repo>/../shared/data, as tests/../../shared/data
    assert REPO_CANDIDATE == SHARED_DATA_DIR.resolve()


def test_default_dirs_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("FMTL_DATA_DIR", str(tmp_path / "env"))
    dirs = default_data_dirs()
    assert dirs == (
        (tmp_path / "env").resolve(),
        (tmp_path / "a" / "shared" / "data").resolve(),
        REPO_CANDIDATE,
    )
    # the module attributes follow the environment
    assert registry.DEFAULT_DATA_DIRS == dirs
    assert data_pkg.DEFAULT_DATA_DIRS == dirs
    monkeypatch.delenv("FMTL_DATA_DIR")
    assert registry.DEFAULT_DATA_DIRS == dirs[1:]
    monkeypatch.setenv("FMTL_DATA_DIR", "")
    assert default_data_dirs() == dirs[1:]


def test_default_dirs_deduplicated(monkeypatch: pytest.MonkeyPatch) -> None:
    # from the repository root, the cwd candidate and the repo candidate coincide
    monkeypatch.chdir(Path(registry.__file__).resolve().parents[2])
    monkeypatch.setenv("FMTL_DATA_DIR", str(REPO_CANDIDATE))
    assert default_data_dirs() == (REPO_CANDIDATE,)


def test_resolve_named_file_via_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, write_mat: MatWriter
) -> None:
    Xs, ys = toy_tasks()
    write_mat("small.mat", X=Xs, Y=ys)
    monkeypatch.setenv("FMTL_DATA_DIR", str(tmp_path))
    assert resolve_data_file("small") == tmp_path.resolve() / "small.mat"
    ds = load_dataset("small", test_frac=0.25)
    assert ds.name == "small" and ds.num_tasks == 3 and ds.dim == 3
    np.testing.assert_array_equal(ds.n_train + ds.n_test, [12, 9, 15])


def test_resolve_named_file_not_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    dirs = (tmp_path / "one", tmp_path / "two")
    monkeypatch.setattr(registry, "default_data_dirs", lambda: dirs)
    with pytest.raises(FileNotFoundError) as info:
        resolve_data_file("eat-voc")
    msg = str(info.value)
    assert str(dirs[0] / "EAT_VOC.mat") in msg and str(dirs[1] / "EAT_VOC.mat") in msg
    assert "FMTL_DATA_DIR" in msg and "path" in msg
    with pytest.raises(FileNotFoundError):
        load_dataset("eat-voc")


def test_resolve_paths(tmp_path: Path, write_mat: MatWriter) -> None:
    Xs, ys = toy_tasks()
    path = write_mat("mine.mat", X=Xs, Y=ys)
    assert resolve_data_file(str(path)) == path
    assert resolve_data_file(path) == path
    missing = tmp_path / "missing.mat"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        resolve_data_file(str(missing))
    with pytest.raises(FileNotFoundError, match="relative.mat"):
        resolve_data_file("relative.mat")
    with pytest.raises(FileNotFoundError, match="no/such"):
        resolve_data_file("no/such")


@pytest.mark.parametrize("name", ["nope", "SMALL", "eat_voc", ""])
def test_unknown_names(name: str) -> None:
    pattern = (
        r"unknown dataset .*\['synthetic', 'fedem-synthetic', 'sparse-federated', "
        r"'digits-dirichlet', 'small', 'eat-voc', 'har', "
        r"'vehicle', 'gleam'\]"
    )
    with pytest.raises(ValueError, match=pattern):
        load_dataset(name)
    with pytest.raises(ValueError, match=pattern):
        resolve_data_file(name)
    with pytest.raises(ValueError, match=pattern):
        load_dataset_cached(name)


def test_load_path_dataset_named_by_stem(write_mat: MatWriter) -> None:
    Xs, ys = toy_tasks()
    path = write_mat("my_tasks.mat", X_ori=Xs, Y_ori=ys)
    ds = load_dataset(str(path), seed=3, test_frac=0.0)
    assert ds.name == "my_tasks"
    assert np.all(ds.n_test == 0)
    np.testing.assert_array_equal(ds.task(0).X_train, Xs[0])


def test_generator_keys_rejected_for_files(write_mat: MatWriter) -> None:
    Xs, ys = toy_tasks()
    path = write_mat("f.mat", X=Xs, Y=ys)
    with pytest.raises(ValueError, match=r"num_tasks, dim only apply to generated datasets"):
        load_dataset(str(path), num_tasks=3, dim=2)
    with pytest.raises(ValueError, match=r"samples_per_task only apply to generated"):
        load_dataset("small", samples_per_task=10)


def test_synthetic_overrides_and_determinism() -> None:
    ds = load_dataset("synthetic", seed=1, num_tasks=4, dim=6, samples_per_task=30)
    assert ds.name == "synthetic" and ds.num_tasks == 4 and ds.dim == 6
    again = load_dataset(seed=1, num_tasks=4, dim=6, samples_per_task=30)
    assert _same_arrays(ds, again)
    other = load_dataset(seed=2, num_tasks=4, dim=6, samples_per_task=30)
    assert not _same_arrays(ds, other)
    default = load_dataset()
    assert default.num_tasks == 30 and default.dim == 20


def test_synthetic_split_uses_test_frac() -> None:
    ds = load_dataset(num_tasks=3, test_frac=0.5)
    n = ds.n_train + ds.n_test
    assert np.all(np.abs(ds.n_test - n / 2) <= 2)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [({"seed": -1}, "seed"), ({"test_frac": 1.0}, "test_frac"), ({"num_tasks": 0}, "num_tasks")],
)
def test_bad_arguments(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        load_dataset(**kwargs)  # type: ignore[arg-type]


def test_cache_returns_same_read_only_object() -> None:
    a = load_dataset_cached(seed=0, num_tasks=3)
    b = load_dataset_cached("synthetic", seed=0, test_frac=0.25, num_tasks=3)
    assert a is b
    for task in a.tasks:
        for arr in task.arrays():
            assert not arr.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        a.task(0).X_train[0, 0] = 1.0
    assert load_dataset_cached(seed=1, num_tasks=3) is not a
    fresh = load_dataset(seed=0, num_tasks=3)
    assert fresh.task(0).X_train.flags.writeable and _same_arrays(fresh, a)
    clear_dataset_cache()
    c = load_dataset_cached(seed=0, num_tasks=3)
    assert c is not a and _same_arrays(a, c)


def test_cache_is_bounded() -> None:
    first = load_dataset_cached(seed=0, num_tasks=2)
    for seed in range(1, 9):
        load_dataset_cached(seed=seed, num_tasks=2)
    assert registry._load_cached.cache_info().currsize == 8
    assert load_dataset_cached(seed=0, num_tasks=2) is not first


def test_real_named_datasets(shared_data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FMTL_DATA_DIR", str(shared_data_dir))
    small = load_dataset("small")
    assert small.name == "small" and small.num_tasks == 29 and small.dim == 9
    np.testing.assert_array_equal((small.n_train + small.n_test)[:4], [69, 69, 68, 50])
    # stratified split; tasks 6 and 8 (1-based) have no positives at all
    for t, task in enumerate(small.tasks):
        y = np.concatenate([task.y_train, task.y_test])
        for label in (-1.0, 1.0):
            n_c = int(np.sum(y == label))
            expected = min(round(0.25 * n_c), n_c - 1) if n_c else 0
            assert int(np.sum(task.y_test == label)) == expected
            assert n_c == 0 or np.any(task.y_train == label)
        assert np.any(y == 1.0) == (t not in (5, 7))
    eat = load_dataset_cached("eat-voc", seed=0)
    assert eat.name == "eat-voc" and eat.num_tasks == 4 and eat.dim == 32
    np.testing.assert_array_equal(eat.n_train + eat.n_test, [5904, 1782, 5357, 2958])
    assert load_dataset_cached("eat-voc") is eat
