"""Tests for fmtl_flower.data.gleam: the window features and the raw GLEAM layout."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from fmtl_flower.data import GLEAM_FEATURE_NAMES, load_dataset, load_gleam_tasks
from fmtl_flower.data.gleam import (
    GLEAM_SENSORS,
    GLEAM_WINDOW_FEATURES,
    gleam_participant_features,
    window_features,
)

from .conftest import DataEnv
from .paper_layouts import tar_gz_tree, write_gleam, zip_tree


def test_feature_names() -> None:
    assert len(GLEAM_FEATURE_NAMES) == 180 == len(set(GLEAM_FEATURE_NAMES))
    assert len(GLEAM_SENSORS) * 3 * len(GLEAM_WINDOW_FEATURES) == 180
    assert GLEAM_FEATURE_NAMES[0] == "accelerometer_x_mean"
    assert GLEAM_FEATURE_NAMES[-1] == "gravity_z_autocorrelation_lag1"


def test_window_features_on_known_signals() -> None:
    fs, n = 5.0, 50  # 10 s at 5 Hz
    t = np.arange(n) / fs
    sine = 2.0 + np.sin(2 * np.pi * 1.0 * t)  # 1 Hz, mean 2, amplitude 1
    const = np.full(n, 3.0)
    f = dict(
        zip(GLEAM_WINDOW_FEATURES, window_features(np.vstack([sine, const]), fs).T, strict=True)
    )
    assert f["mean"] == pytest.approx([2.0, 3.0])
    assert f["std"] == pytest.approx([np.sqrt(0.5), 0.0])
    assert f["skewness"] == pytest.approx([0.0, 0.0], abs=1e-9)
    assert f["kurtosis"] == pytest.approx([-1.5, 0.0])  # excess kurtosis of a sine
    assert f["rms"] == pytest.approx([np.sqrt(4.5), 3.0])
    assert f["spectral_energy"] == pytest.approx([0.25, 0.0])  # one-sided |X_k|^2 / n^2
    assert f["spectral_entropy"] == pytest.approx([0.0, 0.0], abs=1e-9)  # a single line
    assert f["dominant_frequency"] == pytest.approx([1.0, 0.0])
    assert f["mean_crossing_rate"][0] == pytest.approx(2.0, abs=0.11)  # two per period
    assert f["mean_crossing_rate"][1] == 0.0
    assert f["autocorrelation_lag1"][0] == pytest.approx(np.cos(2 * np.pi / fs), abs=0.03)
    assert f["autocorrelation_lag1"][1] == 0.0
    noise = np.random.default_rng(0).standard_normal((1, 4096))
    assert window_features(noise, fs)[0, 6] > 0.9  # white noise: near-maximal entropy


def _streams(seconds: float, hz: float = 4.0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    t = 1000.0 * np.arange(0, seconds, 1 / hz)
    return {s: (t + 3 * k, rng.standard_normal((t.size, 3))) for k, s in enumerate(GLEAM_SENSORS)}


def test_participant_windows_and_labels() -> None:
    streams = _streams(65.0)
    intervals = [
        (0.0, 15_000.0, "Eat "),
        (15_000.0, 20_000.0, "drink"),
        (40_000.0, 45_000.0, "eat"),
    ]
    X, y = gleam_participant_features(streams, intervals, window_s=10.0, fs=5.0)
    assert X.shape == (6, 180)  # [0,10) .. [50,60): the last full window
    # [0,10) all eating, [10,20) half eating (>= 0.5), [40,50) half eating
    np.testing.assert_array_equal(y, [1, 1, -1, -1, 1, -1])
    X2, y2 = gleam_participant_features(streams, intervals, window_s=10.0, unlabeled="drop")
    np.testing.assert_array_equal(y2, [1, 1, 1])  # windows at least half annotated
    X3, _ = gleam_participant_features(streams, intervals, window_s=10.0, step_s=5.0)
    assert X3.shape[0] == 11
    np.testing.assert_array_equal(X3[::2], X)  # overlapping windows include the others


def test_window_without_samples_is_dropped() -> None:
    streams = _streams(40.0)
    t, v = streams["gyroscope"]
    gap = (t >= 10_000) & (t < 20_000)  # gyroscope silent during the second window
    streams["gyroscope"] = (t[~gap], v[~gap])
    X, y = gleam_participant_features(streams, [], window_s=10.0)
    assert X.shape[0] == 2 and np.all(y == -1)  # [0,10) and [20,30); [10,20) dropped


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"window_s": 0.0}, "must be positive"),
        ({"fs": 0.1}, "at least 2 points"),
        ({"unlabeled": "skip"}, "unlabeled must be"),
    ],
)
def test_bad_options(kwargs: dict[str, object], pattern: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=pattern):
        gleam_participant_features(_streams(20.0), [], **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=pattern):  # checked before looking for the data
        load_gleam_tasks(tmp_path / "nowhere", **kwargs)  # type: ignore[arg-type]
    streams = _streams(20.0)
    del streams["gravity"]
    with pytest.raises(ValueError, match="no samples for sensor"):
        gleam_participant_features(streams, [])


def test_raw_layout_tasks_and_labels(tmp_path: Path) -> None:
    root = write_gleam(tmp_path, participants=("1003", "1001", "1002"), seconds=80.0)
    loaded = load_gleam_tasks(root)
    assert loaded.task_names == ["1001", "1002", "1003"]  # by participant number
    for X, y in zip(loaded.Xs, loaded.ys, strict=True):
        assert X.shape == (7, 180)
        # eat 0-30 s, talk 40-60 s, nothing after: windows [0,10) .. [60,70)
        np.testing.assert_array_equal(y, [1, 1, 1, -1, -1, -1, -1])
        dominant = X[
            :, [GLEAM_FEATURE_NAMES.index(f"{s}_x_dominant_frequency") for s in GLEAM_SENSORS]
        ]
        np.testing.assert_allclose(dominant[:3], 1.0)  # the 1 Hz chewing-like oscillation
    dropped = load_gleam_tasks(root, unlabeled="drop")
    np.testing.assert_array_equal(dropped.ys[0], [1, 1, 1, -1, -1])


def test_tar_gz_copy_matches_directory(tmp_path: Path) -> None:
    root = write_gleam(tmp_path / "src", participants=("7", "12"), seconds=30.0)
    archive = tmp_path / "GLEAM.tar.gz"
    archive.write_bytes(tar_gz_tree(root))
    zipped = tmp_path / "GLEAM.zip"
    zipped.write_bytes(zip_tree(root))
    a, b, c = load_gleam_tasks(root), load_gleam_tasks(archive), load_gleam_tasks(zipped)
    assert a.task_names == b.task_names == c.task_names == ["7", "12"]
    for Xa, Xb, Xc in zip(a.Xs, b.Xs, c.Xs, strict=True):
        np.testing.assert_array_equal(Xa, Xb)
        np.testing.assert_array_equal(Xa, Xc)


def test_load_dataset_gleam_via_env(data_env: DataEnv) -> None:
    write_gleam(data_env.data, participants=("1", "2"), seconds=100.0)
    ds = load_dataset("gleam", seed=0, test_frac=0.25)
    assert ds.name == "gleam" and ds.num_tasks == 2 and ds.dim == 180
    np.testing.assert_array_equal(ds.n_train + ds.n_test, [9, 9])
    for task in ds.tasks:
        assert set(np.unique(task.y_train)) == {-1.0, 1.0}


def test_participant_without_a_sensor_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = write_gleam(tmp_path, participants=("1", "2"), seconds=30.0)
    sensor = root / "2" / "2_sensor.csv"
    lines = [ln for ln in sensor.read_text().splitlines() if "Gravity" not in ln]
    sensor.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="fmtl_flower.data.gleam"):
        loaded = load_gleam_tasks(root)
    assert loaded.task_names == ["1"]
    assert "no samples for ['gravity']" in caplog.text


def test_corrupt_participants(tmp_path: Path) -> None:
    root = write_gleam(tmp_path, participants=("1",), seconds=30.0)
    (root / "1" / "1_annotation.csv").unlink()
    with pytest.raises(ValueError, match="one sensor CSV and one annotation CSV, found 1 and 0"):
        load_gleam_tasks(root)
    root = write_gleam(tmp_path / "b", participants=("1",), seconds=30.0)
    sensor = root / "1" / "1_sensor.csv"
    lines = sensor.read_text().splitlines()
    lines[3] = "yesterday," + lines[3].split(",", 1)[1]
    sensor.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"1_sensor.csv: line 4: Unix Time 'yesterday'"):
        load_gleam_tasks(root)
    empty = tmp_path / "empty"
    shutil.copytree(root, empty)
    for f in empty.rglob("*.csv"):
        if f.parent != empty:
            f.unlink()
    with pytest.raises(FileNotFoundError, match="no GLEAM participant found"):
        load_gleam_tasks(empty)
