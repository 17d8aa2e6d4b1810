"""Tests for fmtl_flower.data.vehicle on tiny files in the assumed per-node SensIT layout."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fmtl_flower.data import load_dataset, load_vehicle_tasks
from fmtl_flower.data.vehicle import VEHICLE_NODES

from .conftest import DataEnv
from .paper_layouts import write_vehicle


def test_nodes_are_the_23_sitex02_nodes() -> None:
    assert len(VEHICLE_NODES) == 23 and len(set(VEHICLE_NODES)) == 23


def test_tasks_rows_and_labels(tmp_path: Path) -> None:
    root = write_vehicle(tmp_path, runs=("DW2", "AAV10", "AAV3"), nodes=(41, 1, 5), rows=4)
    loaded = load_vehicle_tasks(root)
    assert loaded.task_names == ["n1", "n5", "n41"]  # by node number
    for X, y, node in zip(loaded.Xs, loaded.ys, (1, 5, 41), strict=True):
        assert X.shape == (12, 100)
        # runs in order AAV3, AAV10, DW2 (written as runs 2, 1, 0): acoustic base 100 r + node
        # + 0.1, seismic + 0.2, each block of 4 rows
        for block, r in enumerate((2, 1, 0)):
            rows = X[4 * block : 4 * block + 4]
            assert np.all(np.floor(rows[:, :50] * 10) == 10 * (100 * r + node) + 1)
            assert np.all(np.floor(rows[:, 50:] * 10) == 10 * (100 * r + node) + 2)
        np.testing.assert_array_equal(y, [1.0] * 8 + [-1.0] * 4)


def test_zip_copy_and_case_insensitive_names(tmp_path: Path) -> None:
    root = write_vehicle(tmp_path / "src", runs=("AAV3", "DW1"), nodes=(2,), rows=3)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for f in sorted(root.rglob("*")):
            if f.is_file():
                arc = "sensit/" + f.relative_to(root).as_posix()
                zf.write(f, arc.replace("AAV3feat", "aav3FEAT"))
    archive = tmp_path / "vehicle.zip"
    archive.write_bytes(buf.getvalue())
    from_dir = load_vehicle_tasks(root)
    from_zip = load_vehicle_tasks(archive)
    np.testing.assert_array_equal(from_dir.Xs[0], from_zip.Xs[0])
    np.testing.assert_array_equal(from_zip.ys[0], [1, 1, 1, -1, -1, -1])


def test_custom_feature_file_pattern(tmp_path: Path) -> None:
    root = write_vehicle(tmp_path, runs=("AAV3",), nodes=(1,), rows=2)
    for f in (root / "AAV3" / "n1").glob("AAV3feat1_*.txt"):
        f.rename(f.with_name(f.name.replace("feat1_", "_node1_")))
    with pytest.raises(FileNotFoundError, match=r"AAV3/n1/AAV3feat1_1.txt"):
        load_vehicle_tasks(root)
    loaded = load_vehicle_tasks(root, feature_file="{run}_node{node}_{modality}.txt")
    assert loaded.Xs[0].shape == (2, 100)


def test_load_dataset_vehicle_via_env(data_env: DataEnv) -> None:
    write_vehicle(data_env.data, rows=8)
    ds = load_dataset("vehicle", seed=1, test_frac=0.25)
    assert ds.name == "vehicle" and ds.num_tasks == 3 and ds.dim == 100
    np.testing.assert_array_equal(ds.n_train + ds.n_test, [24, 24, 24])
    for task in ds.tasks:
        assert set(np.unique(task.y_test)) == {-1.0, 1.0}


def test_download_needs_an_explicit_url(data_env: DataEnv) -> None:
    with pytest.raises(FileNotFoundError, match="no direct download is known"):
        load_dataset("vehicle")
    with pytest.raises(ValueError, match=r"download_dataset\('vehicle', url=\.\.\."):
        load_dataset("vehicle", download=True)


@pytest.mark.parametrize(
    ("mutate", "exc", "pattern"),
    [
        (
            lambda d: (d / "AAV3feat1_2.txt").unlink(),
            FileNotFoundError,
            "run AAV3, node n1 has no seismic feature file",
        ),
        (
            lambda d: (d / "AAV3feat1_2.txt").write_text("1 " * 50 + "\n"),
            ValueError,
            "4 acoustic rows but 1 seismic rows",
        ),
        (
            lambda d: (d / "AAV3feat1_1.txt").write_text("1 2 3\n"),
            ValueError,
            r"AAV3feat1_1.txt: line 1 has 3 values, expected 50",
        ),
        (
            lambda d: (d / "AAV3feat1_1.txt").write_text(("nan " * 50 + "\n") * 4),
            ValueError,
            "line 1 holds a NaN",
        ),
    ],
)
def test_corrupt_files(tmp_path: Path, mutate, exc: type, pattern: str) -> None:  # noqa: ANN001
    root = write_vehicle(tmp_path, runs=("AAV3", "DW1"), nodes=(1,), rows=4)
    mutate(root / "AAV3" / "n1")
    with pytest.raises(exc, match=pattern):
        load_vehicle_tasks(root)


def test_no_feature_files(tmp_path: Path) -> None:
    (tmp_path / "AAV3" / "n1").mkdir(parents=True)
    (tmp_path / "AAV3" / "n1" / "AAV3cpa1_1.txt").write_text("1\n")
    with pytest.raises(FileNotFoundError, match="no Vehicle feature files found"):
        load_vehicle_tasks(tmp_path)
