"""Writers of tiny files in the published layouts of the MOCHA paper's datasets (for tests).

Nothing here is real data: every number is generated from a seed.
"""

from __future__ import annotations

import io
import tarfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

HAR_ACTIVITIES = (
    "WALKING",
    "WALKING_UPSTAIRS",
    "WALKING_DOWNSTAIRS",
    "SITTING",
    "STANDING",
    "LAYING",
)


def uci_number(x: float) -> str:
    """Format like the published X files: ``2.8858451e-001`` (three-digit exponent)."""
    mantissa, exponent = f"{x:.7e}".split("e")
    return f"{mantissa}e{int(exponent):+04d}"


def har_part(rng: np.random.Generator, subjects: Sequence[int], rows: int) -> tuple:
    """(X, y, subject) of one part: ``rows`` windows per subject, activities cycling 1..6."""
    s = np.repeat(np.asarray(subjects), rows)
    y = (np.arange(s.size) % 6) + 1
    X = rng.uniform(-1.0, 1.0, size=(s.size, 561))
    return X, y, s


def write_har(
    parent: Path,
    *,
    train_subjects: Sequence[int] = (1, 3),
    test_subjects: Sequence[int] = (2,),
    rows: int = 7,
    seed: int = 0,
    labels_file: bool = True,
) -> tuple[Path, dict[str, tuple]]:
    """Write ``parent/UCI HAR Dataset`` in the published layout; return it and the parts."""
    rng = np.random.default_rng(seed)
    root = parent / "UCI HAR Dataset"
    parts = {
        "train": har_part(rng, train_subjects, rows),
        "test": har_part(rng, test_subjects, rows),
    }
    for part, (X, y, s) in parts.items():
        d = root / part
        d.mkdir(parents=True)
        lines = ["  " + " ".join(uci_number(v) for v in row) for row in X]
        (d / f"X_{part}.txt").write_text("\n".join(lines) + "\n")
        (d / f"y_{part}.txt").write_text("".join(f"{v}\n" for v in y))
        (d / f"subject_{part}.txt").write_text("".join(f"{v}\n" for v in s))
        (d / "Inertial Signals").mkdir()
    if labels_file:
        text = "".join(f"{i} {a}\n" for i, a in enumerate(HAR_ACTIVITIES, start=1))
        (root / "activity_labels.txt").write_text(text)
    (root / "features.txt").write_text("".join(f"{i} f{i}\n" for i in range(1, 562)))
    (root / "README.txt").write_text("synthetic test copy\n")
    return root, parts


def zip_tree(root: Path, *, with_macosx: bool = True) -> bytes:
    """Zip ``root`` with its own name as the top folder (as UCI's zip), plus macOS clutter."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in sorted(root.rglob("*")):
            if f.is_file():
                arc = f"{root.name}/{f.relative_to(root).as_posix()}"
                zf.write(f, arc)
                if with_macosx:
                    rel = f.relative_to(root)
                    junk = (Path("__MACOSX") / root.name / rel.parent / f"._{f.name}").as_posix()
                    zf.writestr(junk, b"\x00\x05junk")
    return buf.getvalue()


def outer_har_zip(inner: bytes) -> bytes:
    """UCI's current archive: the inner ``UCI HAR Dataset.zip`` and a names file."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("UCI HAR Dataset.names", "names\n")
        zf.writestr("UCI HAR Dataset.zip", inner)
    return buf.getvalue()


def write_vehicle(
    parent: Path,
    *,
    runs: Sequence[str] = ("AAV3", "AAV10", "DW2"),
    nodes: Sequence[int] = (1, 41, 5),
    rows: int = 4,
    seed: int = 0,
) -> Path:
    """Write ``parent/vehicle``: <run>/n<NN>/<run>feat<NN>_{1,2}.txt plus unrelated files."""
    rng = np.random.default_rng(seed)
    root = parent / "vehicle"
    for r, run in enumerate(runs):
        for node in nodes:
            d = root / run / f"n{node}"
            d.mkdir(parents=True)
            for modality in (1, 2):
                base = 100 * r + node + modality / 10
                block = base + rng.uniform(0, 0.01, size=(rows, 50))
                text = "\n".join(" ".join(f"{v:.6f}" for v in row) for row in block)
                (d / f"{run}feat{node}_{modality}.txt").write_text(text + "\n")
            (d / f"{run}cpa{node}_1.txt").write_text("1.0\n2.0\n")  # energy file: ignored
            (d / f"{run}label{node}.txt").write_text("0\n1\n")
        (root / run / "acoustic_1").mkdir()
        (root / run / f"{run}_gt.txt").write_text("0 0\n")
    (root / "nodexy.txt").write_text("1 0 0\n")
    return root


SENSOR_NAMES = {
    "accelerometer": "MPL Accelerometer",
    "gyroscope": "MPL Gyroscope",
    "magnetic_field": "MPL Magnetic Field",
    "rotation_vector": "MPL Rotation Vector",
    "linear_acceleration": "MPL Linear Acceleration",
    "gravity": "MPL Gravity",
}


def gleam_sensor_csv(
    rng: np.random.Generator,
    t0_ms: int,
    seconds: float,
    *,
    hz: float = 4.0,
    skip: Sequence[str] = (),
    eat_until_s: float = 0.0,
) -> str:
    """A sensor CSV: the 6 three-axis sensors and a light sensor, interleaved, in time order.

    Eating (before ``eat_until_s``) is a 1 Hz oscillation on every axis, otherwise noise.
    """
    rows = []
    n = int(seconds * hz)
    for i in range(n):
        t_s = i / hz
        for j, (key, name) in enumerate(SENSOR_NAMES.items()):
            if key in skip:
                continue
            t = t0_ms + int(1000 * t_s) + 7 * j  # irregular: sensors offset in time
            if t_s < eat_until_s:
                v = np.sin(2 * np.pi * 1.0 * t_s + j) + 0.01 * rng.standard_normal(3)
            else:
                v = 0.2 * rng.standard_normal(3)
            rows.append(f"{t},{name},{v[0]:.5f},{v[1]:.5f},{v[2]:.5f}")
        rows.append(f"{t0_ms + int(1000 * t_s) + 50},LTR-506ALS Light sensor,{100 + i},,")
    return "Unix Time,Sensor,Value1,Value2,Value3\n" + "\n".join(rows) + "\n"


def gleam_annotation_csv(t0_ms: int, intervals: Sequence[tuple[float, float, str]]) -> str:
    """Annotation CSV: start/end row pairs (times in ms), plus an unrelated column."""
    rows = []
    for start, end, activity in intervals:
        rows.append(f"{t0_ms + int(1000 * start)},{activity},start")
        rows.append(f"{t0_ms + int(1000 * end)},{activity},end")
    return "unix time,Activity,Status\n" + "\n".join(rows) + "\n"


def write_gleam(
    parent: Path,
    *,
    participants: Sequence[str] = ("1003", "1001", "1002"),
    seconds: float = 80.0,
    seed: int = 0,
) -> Path:
    """Write ``parent/GLEAM``: demographics CSV, README, one directory per participant.

    Each participant eats for the first 30 s, then talks 40-60 s; the rest is unannotated.
    """
    rng = np.random.default_rng(seed)
    root = parent / "GLEAM"
    root.mkdir(parents=True)
    (root / "Demographics_Glass_data.csv").write_text(
        "Id,Age,Gender,Wear glasses?,Annotator,Chair type\n1001,20,M,No,Annotator 1,fixed\n"
    )
    (root / "README_GLEAM.pdf").write_bytes(b"%PDF-1.4 fake")
    for k, pid in enumerate(participants):
        d = root / pid
        d.mkdir()
        t0 = 1_427_000_000_000 + 10_000_000 * k
        (d / f"{pid}_sensor.csv").write_text(gleam_sensor_csv(rng, t0, seconds, eat_until_s=30.0))
        (d / f"{pid}_annotation.csv").write_text(
            gleam_annotation_csv(t0, [(0.0, 30.0, "eat"), (40.0, 60.0, "talk")])
        )
        (d / "start.jpg").write_bytes(b"\xff\xd8\xff")
        (d / "notes.txt").write_text("none\n")
    return root


def tar_gz_tree(root: Path) -> bytes:
    """``root``'s contents as a .tar.gz (members relative to ``root``, as GLEAM.tar.gz)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for f in sorted(root.rglob("*")):
            tf.add(f, arcname=f.relative_to(root).as_posix(), recursive=False)
    return buf.getvalue()
