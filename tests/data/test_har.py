"""Tests for fmtl_flower.data.har on tiny files in the published UCI HAR layout."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fmtl_flower.data import load_dataset, load_har_tasks
from fmtl_flower.data.har import HAR_NUM_FEATURES

from .conftest import DataEnv
from .paper_layouts import outer_har_zip, uci_number, write_har, zip_tree


def _expected(parts: dict[str, tuple]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per subject: pooled rows (train part first) and +-1 labels (4 = SITTING)."""
    X = np.vstack([parts[p][0] for p in ("train", "test")])
    y = np.concatenate([parts[p][1] for p in ("train", "test")])
    s = np.concatenate([parts[p][2] for p in ("train", "test")])
    return {int(k): (X[s == k], np.where(y[s == k] == 4, 1.0, -1.0)) for k in np.unique(s)}


def test_uci_number_format() -> None:
    assert uci_number(0.28858451) == "2.8858451e-001"
    assert float(uci_number(-1.5e-12)) == pytest.approx(-1.5e-12)


def test_directory_layout_tasks_and_labels(tmp_path: Path) -> None:
    root, parts = write_har(tmp_path, train_subjects=(5, 1), test_subjects=(3,), rows=7)
    loaded = load_har_tasks(root)
    assert loaded.task_names == ["subject 1", "subject 3", "subject 5"]
    expected = _expected(parts)
    for X, y, subject in zip(loaded.Xs, loaded.ys, (1, 3, 5), strict=True):
        assert X.shape == (7, HAR_NUM_FEATURES) and X.dtype == np.float64
        # 7-digit mantissas as published: equal to 1e-7 relative
        np.testing.assert_allclose(X, expected[subject][0], rtol=1e-7, atol=1e-8)
        np.testing.assert_array_equal(y, expected[subject][1])
        assert set(np.unique(y)) <= {-1.0, 1.0}
    # activities cycle 1..6 over each part's rows: subject 5 (first in train) has 1..6, 1
    np.testing.assert_array_equal(loaded.ys[2], [-1, -1, -1, 1, -1, -1, -1])


def test_train_and_test_parts_are_pooled_per_subject(tmp_path: Path) -> None:
    # a subject in both published parts gets its train rows first, then its test rows
    root, parts = write_har(tmp_path, train_subjects=(2,), test_subjects=(2, 4), rows=6)
    loaded = load_har_tasks(root)
    assert loaded.task_names == ["subject 2", "subject 4"]
    X_train, X_test = parts["train"][0], parts["test"][0]
    np.testing.assert_allclose(loaded.Xs[0], np.vstack([X_train, X_test[:6]]), rtol=1e-7)


def test_zip_and_nested_zip(tmp_path: Path) -> None:
    root, _ = write_har(tmp_path / "src")
    direct = load_har_tasks(root)
    inner = tmp_path / "UCI HAR Dataset.zip"
    inner.write_bytes(zip_tree(root))
    outer = tmp_path / "human+activity+recognition+using+smartphones.zip"
    outer.write_bytes(outer_har_zip(inner.read_bytes()))
    for path in (inner, outer):
        loaded = load_har_tasks(path)
        assert loaded.task_names == direct.task_names
        for a, b in zip(loaded.Xs, direct.Xs, strict=True):
            np.testing.assert_array_equal(a, b)


def test_sitting_code_read_from_activity_labels(tmp_path: Path) -> None:
    root, parts = write_har(tmp_path, rows=6)
    # relabel: SITTING is code 2 in this copy
    (root / "activity_labels.txt").write_text("1 WALKING\n2 SITTING\n4 STANDING\n")
    loaded = load_har_tasks(root)
    np.testing.assert_array_equal(loaded.ys[0], [-1, 1, -1, -1, -1, -1])
    (root / "activity_labels.txt").unlink()
    np.testing.assert_array_equal(load_har_tasks(root).ys[0], [-1, -1, -1, 1, -1, -1])


def test_load_dataset_har_via_env(data_env: DataEnv) -> None:
    write_har(data_env.data, train_subjects=(1, 2, 3), test_subjects=(4,), rows=12)
    ds = load_dataset("har", seed=3, test_frac=0.25)
    assert ds.name == "har" and ds.num_tasks == 4 and ds.dim == 561
    np.testing.assert_array_equal(ds.n_train + ds.n_test, [12] * 4)
    # 2 positives and 10 negatives per subject: round(0.5) = 0 and round(2.5) = 2 test rows
    np.testing.assert_array_equal(ds.n_test, [2] * 4)
    again = load_dataset("har", seed=3, test_frac=0.25)
    np.testing.assert_array_equal(ds.task(2).X_test, again.task(2).X_test)


def test_load_dataset_har_from_zip_in_data_dir(data_env: DataEnv, tmp_path: Path) -> None:
    root, _ = write_har(tmp_path / "src")
    (data_env.data / "UCI HAR Dataset.zip").write_bytes(zip_tree(root))
    assert load_dataset("har", test_frac=0.0).num_tasks == 3


def test_data_path_argument(tmp_path: Path) -> None:
    root, _ = write_har(tmp_path)
    ds = load_dataset("har", data_path=root, test_frac=0.0)
    assert ds.num_tasks == 3 and np.all(ds.n_test == 0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dataset("har", data_path=tmp_path / "nope")


def test_missing_copy_error_lists_candidates_and_download(data_env: DataEnv) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_dataset("har")
    msg = str(info.value)
    assert str(data_env.data / "UCI HAR Dataset") in msg
    assert str(data_env.cache.resolve() / "UCI HAR Dataset.zip") in msg
    assert "download_dataset('har'" in msg and "FMTL_DATA_DIR" in msg


@pytest.mark.parametrize(
    ("mutate", "exc", "pattern"),
    [
        (lambda r: (r / "train" / "y_train.txt").unlink(), FileNotFoundError, "y_train.txt"),
        (
            lambda r: (r / "test" / "X_test.txt").write_text("1.0 2.0\n"),
            ValueError,
            r"X_test.txt: line 1 has 2 values, expected 561",
        ),
        (
            lambda r: (r / "train" / "y_train.txt").write_text("1\n2\n"),
            ValueError,
            r"train part has 14 rows in X_train.txt, 2 in y_train.txt",
        ),
        (
            lambda r: (r / "train" / "y_train.txt").write_text("7\n" * 14),
            ValueError,
            r"y_train.txt: activity codes must be 1..6, found \[7\]",
        ),
        (
            lambda r: (r / "test" / "subject_test.txt").write_text("2\nx\n" + "2\n" * 5),
            ValueError,
            r"subject_test.txt: line 2: not a number",
        ),
        (
            lambda r: (r / "activity_labels.txt").write_text("1 WALKING\n"),
            ValueError,
            "no SITTING",
        ),
    ],
)
def test_corrupt_copies(tmp_path: Path, mutate, exc: type, pattern: str) -> None:  # noqa: ANN001
    root, _ = write_har(tmp_path)
    mutate(root)
    with pytest.raises(exc, match=pattern):
        load_har_tasks(root)


def test_not_a_har_tree(tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("1\n")
    with pytest.raises(FileNotFoundError, match=re.escape("no train/X_train.txt found")):
        load_har_tasks(tmp_path / "other")
    bad = tmp_path / "broken.zip"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ValueError, match="not a readable zip archive"):
        load_har_tasks(bad)
