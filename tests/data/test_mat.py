"""Tests for fmtl_flower.data.mat (synthetic .mat files and the shared reference files)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fmtl_flower.data import load_mat_tasks

from .helpers import MatWriter, toy_tasks

SMALL_N = [69, 69, 68, 50, 50, 50, 51, 51, 50, 50, 68, 68, 50, 51, 50,
           44, 44, 44, 44, 44, 45, 45, 44, 44, 44, 44, 44, 45, 44]  # fmt: skip
EAT_VOC_N = [5904, 1782, 5357, 2958]


@pytest.mark.parametrize("keys", [("X", "Y"), ("X_ori", "Y_ori")])
def test_both_layouts(write_mat: MatWriter, keys: tuple[str, str]) -> None:
    Xs, ys = toy_tasks()
    path = write_mat("ok.mat", **{keys[0]: Xs, keys[1]: ys})
    Xl, yl = load_mat_tasks(path)
    assert len(Xl) == len(yl) == 3
    for X, y, X0, y0 in zip(Xl, yl, Xs, ys, strict=True):
        assert X.dtype == np.float64 and X.flags.c_contiguous
        assert y.dtype == np.float64 and y.shape == (X0.shape[0],)
        np.testing.assert_array_equal(X, X0)
        np.testing.assert_array_equal(y, y0.ravel())


def test_accepts_str_path_and_column_cells(write_mat: MatWriter) -> None:
    Xs, ys = toy_tasks(sizes=(5, 6))
    col = np.empty((2, 1), dtype=object)
    col[0, 0], col[1, 0] = Xs
    ycol = np.empty((2, 1), dtype=object)
    ycol[0, 0], ycol[1, 0] = ys
    path = write_mat("col.mat", X=col, Y=ycol)
    Xl, _ = load_mat_tasks(str(path))
    assert [X.shape for X in Xl] == [(5, 3), (6, 3)]


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.mat"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        load_mat_tasks(path)


def test_directory_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a regular file"):
        load_mat_tasks(tmp_path)


@pytest.mark.parametrize(
    "content", [b"this is not a MATLAB file " * 10, b"", bytes(range(256)) * 4]
)
def test_not_a_mat_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.mat"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": not a readable"):
        load_mat_tasks(path)


def test_missing_keys_listed(write_mat: MatWriter) -> None:
    Xs, ys = toy_tasks()
    path = write_mat("keys.mat", A=Xs, Y=ys, note=np.array([1.0]))
    with pytest.raises(ValueError) as info:
        load_mat_tasks(path)
    msg = str(info.value)
    assert str(path) in msg
    assert "['A', 'Y', 'note']" in msg
    assert "'X'/'Y'" in msg and "'X_ori'/'Y_ori'" in msg


def test_mismatched_cell_counts(write_mat: MatWriter) -> None:
    Xs, ys = toy_tasks()
    path = write_mat("count.mat", X=Xs, Y=ys[:2])
    with pytest.raises(ValueError, match="'X' has 3 cells but 'Y' has 2"):
        load_mat_tasks(path)


def test_labels_0_2_rejected(write_mat: MatWriter) -> None:
    Xs, ys = toy_tasks()
    ys[1] = np.where(ys[1] > 0, 2, 0).astype(np.int16)
    path = write_mat("labels.mat", X=Xs, Y=ys)
    pattern = re.escape(f"{path}: task 1: labels must be in {{-1, 1}}") + r".*\[0, 2\]"
    with pytest.raises(ValueError, match=pattern):
        load_mat_tasks(path)


def test_nan_in_x_rejected(write_mat: MatWriter) -> None:
    Xs, ys = toy_tasks()
    Xs[2][4, 1] = np.nan
    path = write_mat("nan.mat", X=Xs, Y=ys)
    with pytest.raises(ValueError, match=re.escape(f"{path}: task 2: X contains 1 non-finite")):
        load_mat_tasks(path)


def test_label_count_mismatch_in_a_task(write_mat: MatWriter) -> None:
    Xs, ys = toy_tasks()
    ys[0] = ys[0][:-1]
    path = write_mat("len.mat", X=Xs, Y=ys)
    with pytest.raises(ValueError, match=re.escape(f"{path}: task 0: y has 11 labels")):
        load_mat_tasks(path)


def test_different_dims_rejected(write_mat: MatWriter) -> None:
    Xs, ys = toy_tasks()
    Xs[1] = Xs[1][:, :2]
    path = write_mat("dims.mat", X=Xs, Y=ys)
    with pytest.raises(ValueError, match="task 1 has 2 features but task 0 has 3"):
        load_mat_tasks(path)


def test_plain_matrix_instead_of_cell(write_mat: MatWriter) -> None:
    path = write_mat("plain.mat", X=np.ones((4, 2)), Y=np.ones((4, 1)))
    with pytest.raises(ValueError, match="'X' must be a 1 x m cell array"):
        load_mat_tasks(path)


def test_real_small(shared_data_dir: Path) -> None:
    Xs, ys = load_mat_tasks(shared_data_dir / "small.mat")
    assert len(Xs) == 29
    assert [X.shape[0] for X in Xs] == SMALL_N
    assert {X.shape[1] for X in Xs} == {9}
    y = np.concatenate(ys)
    assert y.size == 1464 and int(np.sum(y == 1)) == 89 and int(np.sum(y == -1)) == 1375
    assert not np.any(ys[5] == 1) and not np.any(ys[7] == 1)  # tasks 6 and 8 (1-based)


def test_real_eat_voc(shared_data_dir: Path) -> None:
    Xs, ys = load_mat_tasks(shared_data_dir / "EAT_VOC.mat")
    assert [X.shape for X in Xs] == [(n, 32) for n in EAT_VOC_N]
    assert [int(np.sum(y == -1)) for y in ys] == [3996, 898, 3023, 1132]
    assert all(y.dtype == np.float64 and y.ndim == 1 for y in ys)
