"""GLEAM (Glass Eating and Motion, Rahman et al. 2015) featurised as in MOCHA, one task per person.

What MOCHA specifies (Smith et al. 2017, section 5.1 and Table 2; its appendix adds nothing
more): "two hours of high resolution sensor data collected from 38 participants wearing Google
Glass ... Following [41] (Rahman et al.), we featurize the raw accelerometer, gyroscope, and
magnetometer data into 180 statistical, spectral, and temporal features. We model each
participant as a separate task, and predict between eating and other activities (e.g.,
walking, talking, drinking)"; 38 tasks, d = 180, 524..581 training instances per task.
The OFMTL paper, on the same data, is more explicit about the same recipe without the
temporal part: "a 144-element vector ... including 5 statistical and 3 spectral features for
6 sensors with 3 axes".

Raw layout read (``GLEAM.tar.gz`` from http://www.skleinberg.org/data/GLEAM.tar.gz, as read by
the public loader ``vaseline555/Federated-Learning-in-PyTorch``, ``src/datasets/gleam.py``):
one directory per participant, holding (besides food photos and notes) two CSV files,
recognised here by their header rather than their name:

* sensor file: columns ``Unix Time`` (ms), ``Sensor`` (the Android sensor name; that loader
  tells the sensors apart by the words Gyroscope, Accelerometer, Magnetic, Rotation, Linear,
  Gravity and Light in it, and so does :func:`_canonical_sensor`), ``Value1``, ``Value2``,
  ``Value3`` (x, y, z; empty for the one-axis light sensor);
* annotation file: columns ``unix time`` (ms) and ``Activity`` (``eat``, ``drink``, ``walk``,
  ``talk``, ``stair``, ...), in start/end row pairs (row 2i starts an activity, row 2i+1 ends
  it; the activity is the start row's).

A demographics CSV at the top and any other file are ignored. Participants are ordered by the
number in their directory name.

**As specified**: one task per participant; label ``+1`` for eating (annotated activity
``eat``/``eating``, case-insensitive), ``-1`` for everything else; 180 statistical, spectral and
temporal features from the accelerometer, gyroscope and magnetometer data.

**Inferred** from the two papers' numbers: 180 = 6 three-axis sensors x 3 axes x 10 features,
the 10 being OFMTL's 5 statistical + 3 spectral plus 2 temporal (180 - 144 = 36 = 18 x 2). The
6 sensors are Glass's three-axis streams, all derived from its accelerometer, gyroscope and
magnetometer: accelerometer, gyroscope, magnetic field, rotation vector, linear acceleration,
gravity (the light sensor is not used). Windows: non-overlapping 10 s windows tiling each
recording (Table 2's 524..581 training windows at 75 % are ~700..775 windows per participant,
~10 s each over two hours); hence also time outside any annotated activity counts as "other"
(``unlabeled="other"``; ``"drop"`` keeps only windows at least half covered by annotations).

**Approximated** (our choices; Rahman et al.'s exact definitions were not available):

* a window's label is ``+1`` if at least half of it lies inside ``eat`` intervals;
* each axis is linearly interpolated onto a uniform ``fs = 5`` Hz grid before the features
  (Glass reports each sensor irregularly, every ~200-400 ms according to a third-party
  description); a window is dropped unless each of the 6 sensors has at least 2 raw samples
  in it;
* which 10 features (:data:`GLEAM_WINDOW_FEATURES`): statistical -- mean, standard deviation,
  skewness, excess kurtosis, root mean square; spectral (on the mean-removed window, DC
  excluded) -- energy ``sum_k |X_k|^2 / n^2``, normalised spectral entropy, dominant frequency
  (Hz); temporal -- mean-crossing rate (per second), lag-1 autocorrelation. Constant windows
  get 0 for every shape feature.

``window_s``, ``step_s``, ``fs`` and ``unlabeled`` are parameters of :func:`load_gleam_tasks`.
Feature order: sensor-major, then axis, then feature (:data:`GLEAM_FEATURE_NAMES`). Features
are not standardised (neither are the other datasets').
"""

from __future__ import annotations

import csv
import io
import itertools
import logging
import os
import re
from collections import defaultdict
from collections.abc import Iterator, Sequence

import numpy as np

from fmtl_flower.data.archive import FileTree, open_tree
from fmtl_flower.data.dataset import LoadedTasks
from fmtl_flower.data.download import locate_dataset
from fmtl_flower.data.validation import loaded_tasks

__all__ = [
    "GLEAM_AXES",
    "GLEAM_FEATURE_NAMES",
    "GLEAM_SENSORS",
    "GLEAM_WINDOW_FEATURES",
    "gleam_participant_features",
    "load_gleam_tasks",
    "window_features",
]

log = logging.getLogger(__name__)

#: The six three-axis sensors used, in feature order.
GLEAM_SENSORS: tuple[str, ...] = (
    "accelerometer",
    "gyroscope",
    "magnetic_field",
    "rotation_vector",
    "linear_acceleration",
    "gravity",
)

#: Axes (``Value1``, ``Value2``, ``Value3``).
GLEAM_AXES: tuple[str, ...] = ("x", "y", "z")

#: The 10 features computed per axis and window (see :func:`window_features`).
GLEAM_WINDOW_FEATURES: tuple[str, ...] = (
    "mean",
    "std",
    "skewness",
    "kurtosis",
    "rms",
    "spectral_energy",
    "spectral_entropy",
    "dominant_frequency",
    "mean_crossing_rate",
    "autocorrelation_lag1",
)

#: Names of the 180 columns, ``<sensor>_<axis>_<feature>``.
GLEAM_FEATURE_NAMES: tuple[str, ...] = tuple(
    f"{s}_{a}_{f}" for s in GLEAM_SENSORS for a in GLEAM_AXES for f in GLEAM_WINDOW_FEATURES
)

_EATING = frozenset({"eat", "eating"})
_SENSOR_COLS = ("unix time", "sensor", "value1", "value2", "value3")
_ANNOTATION_COLS = ("unix time", "activity")


def _canonical_sensor(raw: str) -> str | None:
    """Map an Android sensor name to one of :data:`GLEAM_SENSORS`, or None (not used)."""
    low = raw.lower()
    if "linear" in low:
        return "linear_acceleration"
    if "gravity" in low:
        return "gravity"
    if "accelerometer" in low:
        return "accelerometer"
    if "gyroscope" in low:
        return "gyroscope"
    if "magnetic" in low or "magnetometer" in low:
        return "magnetic_field"
    if "rotation" in low:
        return "rotation_vector"
    return None


def window_features(windows: np.ndarray, fs: float) -> np.ndarray:
    """The 10 per-axis features of :data:`GLEAM_WINDOW_FEATURES` for each window.

    Parameters
    ----------
    windows : np.ndarray
        Uniformly sampled windows, shape ``(n_windows, n)`` with ``n >= 2``.
    fs : float
        Sampling rate in Hz.

    Returns
    -------
    np.ndarray
        Shape ``(n_windows, 10)``: mean, standard deviation (population), skewness, excess
        kurtosis, RMS, spectral energy ``sum_{k>=1} |X_k|^2 / n^2`` of the mean-removed window
        (one-sided ``rfft``), spectral entropy (Shannon entropy of the normalised power
        spectrum over ``k >= 1``, divided by its maximum ``log2(K)``), dominant frequency (Hz,
        ``k >= 1``), mean-crossing rate (sign changes of the mean-removed window per second),
        lag-1 autocorrelation. Windows with (numerically) zero spread get 0 for every feature
        except mean and RMS.
    """
    W = np.asarray(windows, dtype=np.float64)
    n = W.shape[1]
    mean = W.mean(axis=1)
    C = W - mean[:, None]
    var = (C**2).mean(axis=1)
    std = np.sqrt(var)
    flat = std <= 1e-12 * (np.abs(mean) + 1.0)
    C[flat] = 0.0
    var = np.where(flat, 0.0, var)
    std = np.where(flat, 0.0, std)
    safe_var = np.where(flat, 1.0, var)
    skew = np.where(flat, 0.0, (C**3).mean(axis=1) / safe_var**1.5)
    kurt = np.where(flat, 0.0, (C**4).mean(axis=1) / safe_var**2 - 3.0)
    rms = np.sqrt((W**2).mean(axis=1))
    power = np.abs(np.fft.rfft(C, axis=1)[:, 1:]) ** 2 / n**2
    energy = power.sum(axis=1)
    k = power.shape[1]
    has_power = energy > 0
    p = power / np.where(has_power, energy, 1.0)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log2(np.where(p > 0, p, 1.0)), 0.0)
    entropy = -plogp.sum(axis=1) / np.log2(k) if k > 1 else np.zeros(len(W))
    entropy = np.where(has_power, entropy, 0.0)
    freqs = np.fft.rfftfreq(n, d=1.0 / fs)[1:]
    dominant = np.where(has_power, freqs[np.argmax(power, axis=1)], 0.0)
    signs = C >= 0
    crossings = (signs[:, 1:] != signs[:, :-1]).sum(axis=1) / (n / fs)
    crossings = np.where(flat, 0.0, crossings)
    denom = np.where(flat, 1.0, (C**2).sum(axis=1))
    ac1 = np.where(flat, 0.0, (C[:, :-1] * C[:, 1:]).sum(axis=1) / denom)
    return np.column_stack([mean, std, skew, kurt, rms, energy, entropy, dominant, crossings, ac1])


def _check_options(
    window_s: float, step_s: float | None, fs: float, unlabeled: str
) -> tuple[float, int]:
    """Validate the featurisation options; return ``(step_s, points per window)``."""
    step_s = window_s if step_s is None else step_s
    if not (window_s > 0 and step_s > 0 and fs > 0):
        raise ValueError(
            f"window_s, step_s and fs must be positive, got {window_s}, {step_s}, {fs}"
        )
    n_per = int(round(window_s * fs))
    if n_per < 2:
        raise ValueError(f"window_s * fs must give at least 2 points per window, got {n_per}")
    if unlabeled not in ("other", "drop"):
        raise ValueError(f"unlabeled must be 'other' or 'drop', got {unlabeled!r}")
    return step_s, n_per


def gleam_participant_features(
    streams: dict[str, tuple[np.ndarray, np.ndarray]],
    intervals: Sequence[tuple[float, float, str]],
    *,
    window_s: float = 10.0,
    step_s: float | None = None,
    fs: float = 5.0,
    unlabeled: str = "other",
) -> tuple[np.ndarray, np.ndarray]:
    """Windowed 180-feature vectors and eating labels for one participant.

    Parameters
    ----------
    streams : dict
        ``sensor -> (times_ms, values)`` for each of :data:`GLEAM_SENSORS` (``times_ms``
        shape ``(n,)``, ``values`` shape ``(n, 3)``); times need not be sorted.
    intervals : sequence of (start_ms, end_ms, activity)
        Annotated activities.
    window_s : float, default 10.0
        Window length in seconds.
    step_s : float, optional
        Window step in seconds; default ``window_s`` (non-overlapping windows).
    fs : float, default 5.0
        Resampling rate in Hz (each window holds ``round(window_s * fs)`` points, >= 2).
    unlabeled : {"other", "drop"}, default "other"
        ``"other"``: every window is kept (time outside annotations is "other");
        ``"drop"``: keep windows at least half covered by annotated activities.

    Returns
    -------
    X : np.ndarray
        Shape ``(n_windows, 180)``, columns :data:`GLEAM_FEATURE_NAMES` (``n_windows`` may
        be 0).
    y : np.ndarray
        ``+1`` where at least half the window lies in ``eat`` intervals, else ``-1``.

    Raises
    ------
    ValueError
        Bad ``window_s`` / ``step_s`` / ``fs`` / ``unlabeled``, or a sensor missing from
        ``streams``.
    """
    step_s, n_per = _check_options(window_s, step_s, fs, unlabeled)
    missing = [s for s in GLEAM_SENSORS if s not in streams or len(streams[s][0]) == 0]
    if missing:
        raise ValueError(f"no samples for sensor(s) {missing}")
    sorted_streams = {}
    for s in GLEAM_SENSORS:
        t, v = streams[s]
        order = np.argsort(t, kind="stable")
        sorted_streams[s] = (np.asarray(t, float)[order], np.asarray(v, float)[order])
    t0 = min(t[0] for t, _ in sorted_streams.values())
    t1 = max(t[-1] for t, _ in sorted_streams.values())
    win_ms, step_ms = window_s * 1000.0, step_s * 1000.0
    n_win = int(np.floor((t1 - t0 - win_ms) / step_ms)) + 1 if t1 - t0 >= win_ms else 0
    if n_win <= 0:
        return np.zeros((0, len(GLEAM_FEATURE_NAMES))), np.zeros(0)
    starts = t0 + step_ms * np.arange(n_win)
    grid = starts[:, None] + (np.arange(n_per) * (1000.0 / fs))[None, :]
    valid = np.ones(n_win, dtype=bool)
    for t, _ in sorted_streams.values():
        counts = np.searchsorted(t, starts + win_ms, "left") - np.searchsorted(t, starts, "left")
        valid &= counts >= 2
    eat = np.zeros(grid.shape, dtype=bool)
    annotated = np.zeros(grid.shape, dtype=bool)
    for start, end, activity in intervals:
        inside = (grid >= start) & (grid < end)
        annotated |= inside
        if activity.strip().lower() in _EATING:
            eat |= inside
    if unlabeled == "drop":
        valid &= annotated.mean(axis=1) >= 0.5
    grid, eat = grid[valid], eat[valid]
    blocks = []
    for s in GLEAM_SENSORS:
        t, v = sorted_streams[s]
        for axis in range(3):
            W = np.interp(grid.ravel(), t, v[:, axis]).reshape(grid.shape)
            blocks.append(window_features(W, fs))
    X = np.hstack(blocks) if grid.shape[0] else np.zeros((0, len(GLEAM_FEATURE_NAMES)))
    y = np.where(eat.mean(axis=1) >= 0.5, 1.0, -1.0)
    return X, y


def _norm(col: str) -> str:
    return " ".join(col.replace("\ufeff", "").strip().lower().split())


def _csv_columns(text: str) -> tuple[list[str], dict[str, int], list[tuple[str, ...]]]:
    """Header, normalised column index, and the data columns (blank lines kept as "")."""
    reader = csv.reader(io.StringIO(text))
    header = next(reader, [])
    rows = list(reader)
    ncols = max([len(header), *map(len, rows)]) if rows else len(header)
    columns = list(itertools.zip_longest(*rows, fillvalue="")) if rows else []
    columns += [("",) * len(rows)] * (ncols - len(columns))
    return header, {_norm(c): j for j, c in enumerate(header)}, columns


def _kind(header: list[str]) -> str | None:
    cols = {_norm(c) for c in header}
    if all(c in cols for c in _SENSOR_COLS):
        return "sensor"
    if all(c in cols for c in _ANNOTATION_COLS):
        return "annotation"
    return None


def _floats(column: Sequence[str], where: str, what: str, strict: bool) -> np.ndarray:
    """A column as float64; empty entries are NaN, other bad ones too unless ``strict``.

    Data row ``i`` is line ``i + 2`` of the file (the header is line 1).
    """
    raw = [entry.strip() or "nan" for entry in column]
    try:
        return np.array(raw, dtype=np.float64)
    except ValueError:
        pass
    out = np.empty(len(raw))
    for i, entry in enumerate(raw):
        try:
            out[i] = float(entry)
        except ValueError:
            if strict:
                raise ValueError(
                    f"{where}: line {i + 2}: {what} {entry!r} is not a number"
                ) from None
            out[i] = np.nan
    return out


def _parse_sensor(text: str, where: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``sensor -> (times_ms, values)`` for :data:`GLEAM_SENSORS`; rows with a missing time or
    value are left out."""
    _, index, cols = _csv_columns(text)
    if not cols:
        return {s: (np.zeros(0), np.zeros((0, 3))) for s in GLEAM_SENSORS}
    times = _floats(cols[index["unix time"]], where, "Unix Time", strict=True)
    values = np.column_stack(
        [_floats(cols[index[f"value{k}"]], where, f"Value{k}", strict=False) for k in (1, 2, 3)]
    )
    names = cols[index["sensor"]]
    code = {raw: _canonical_sensor(raw) for raw in set(names)}
    ids = np.array([GLEAM_SENSORS.index(c) if c else -1 for c in map(code.get, names)])
    ok = np.isfinite(times) & np.isfinite(values).all(axis=1)
    return {
        s: (times[ok & (ids == k)], values[ok & (ids == k)]) for k, s in enumerate(GLEAM_SENSORS)
    }


def _parse_annotation(text: str, where: str) -> list[tuple[float, float, str]]:
    """(start_ms, end_ms, activity) from consecutive start/end rows (blank lines skipped)."""
    _, index, cols = _csv_columns(text)
    if not cols:
        return []
    times = _floats(cols[index["unix time"]], where, "unix time", strict=True)
    acts = [a.strip() for a in cols[index["activity"]]]
    rows = [i for i in range(len(times)) if np.isfinite(times[i])]
    if len(rows) % 2:
        log.warning("%s: odd number of annotation rows (%d); last one ignored", where, len(rows))
    intervals = []
    for i, j in zip(rows[0::2], rows[1::2], strict=False):
        start, end = times[i], times[j]
        if end < start:
            log.warning(
                "%s: lines %d-%d: interval ends before it starts, ignored", where, i + 2, j + 2
            )
            continue
        intervals.append((float(start), float(end), acts[i]))
    return intervals


def _participant_key(directory: str) -> tuple[int, str]:
    base = directory.rstrip("/").rsplit("/", 1)[-1]
    m = re.search(r"(\d+)$", base)
    return (int(m.group(1)) if m else -1, base)


def _load_tree(tree: FileTree, **options: object) -> LoadedTasks:
    by_dir: dict[str, list[str]] = defaultdict(list)
    for f in tree.files:
        if f.lower().endswith(".csv"):
            by_dir[f.rsplit("/", 1)[0] if "/" in f else ""].append(f)
    participants = []
    for directory, files in by_dir.items():
        kinds: dict[str, list[str]] = defaultdict(list)
        for f in files:
            head = tree.read_head(f, 4096).decode("utf-8", errors="replace")
            kind = _kind(next(csv.reader([head.split("\n", 1)[0]]), []))
            if kind is not None:
                kinds[kind].append(f)
        if not kinds["sensor"]:
            continue
        label = tree.where(directory) if directory else tree.label
        if len(kinds["sensor"]) > 1 or len(kinds["annotation"]) != 1:
            raise ValueError(
                f"{label}: expected one sensor CSV and one annotation CSV, found "
                f"{len(kinds['sensor'])} and {len(kinds['annotation'])}"
            )
        participants.append((directory, label, kinds["sensor"][0], kinds["annotation"][0]))
    if not participants:
        raise FileNotFoundError(
            f"{tree.label}: no GLEAM participant found (a directory with a sensor CSV: "
            f"columns {', '.join(_SENSOR_COLS)}; and an annotation CSV: "
            f"{', '.join(_ANNOTATION_COLS)})"
        )
    return loaded_tasks(_participant_tasks(tree, participants, options), name=tree.label,
                        empty="no participant has a usable window")


def _participant_tasks(tree: FileTree, participants: list[tuple[str, str, str, str]],
                       options: dict[str, object]) -> Iterator[tuple]:
    """Every participant with a usable window, in order: ``(X, y, where, name)`` as
    :func:`loaded_tasks` reads them (the others skipped with a warning)."""
    for directory, label, sf, af in sorted(participants, key=lambda p: _participant_key(p[0])):
        streams = _parse_sensor(tree.read_text(sf), tree.where(sf))
        intervals = _parse_annotation(tree.read_text(af), tree.where(af))
        absent = [s for s in GLEAM_SENSORS if len(streams[s][0]) == 0]
        if absent:
            log.warning("%s: participant skipped (no samples for %s)", label, absent)
            continue
        X, y = gleam_participant_features(streams, intervals, **options)  # type: ignore[arg-type]
        if X.shape[0] == 0:
            log.warning("%s: participant skipped (no usable window)", label)
            continue
        yield X, y, label, directory.rsplit("/", 1)[-1] if directory else "participant"


def load_gleam_tasks(
    path: str | os.PathLike[str] | None = None,
    *,
    download: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    window_s: float = 10.0,
    step_s: float | None = None,
    fs: float = 5.0,
    unlabeled: str = "other",
) -> LoadedTasks:
    """Featurise GLEAM's raw streams: one task per participant, +1 eating / -1 other.

    What is exact and what is approximated is listed in :mod:`fmtl_flower.data.gleam`.

    Parameters
    ----------
    path : str or os.PathLike, optional
        A local copy: the unpacked directory or ``GLEAM.tar.gz``. Default: looked for by
        :func:`~fmtl_flower.data.download.locate_dataset` (``$FMTL_DATA_DIR/GLEAM``,
        ``GLEAM.tar.gz``, ``gleam``, then the cache).
    download : bool, default False
        If no local copy is found, download ``GLEAM.tar.gz`` into the cache first.
    cache_dir : str or os.PathLike, optional
        Cache directory to search and download into.
    window_s, step_s, fs, unlabeled
        See :func:`gleam_participant_features`.

    Returns
    -------
    LoadedTasks
        ``Xs`` (each ``(n_t, 180)``), ``ys`` in ``{-1, +1}``, ``task_names`` (participant
        directory names), by participant number. A participant without any usable window (or
        without one of the six sensors) is skipped with a logged warning.

    Raises
    ------
    FileNotFoundError
        No local copy (the message lists where it looked and how to download), or no
        participant directory in it.
    ValueError
        A participant directory without exactly one sensor and one annotation CSV, a
        non-numeric timestamp (file and line named), bad options, or no usable window at all.
    """
    _check_options(window_s, step_s, fs, unlabeled)
    where = locate_dataset("gleam", path, download=download, cache_dir=cache_dir)
    with open_tree(where) as tree:
        return _load_tree(tree, window_s=window_s, step_s=step_s, fs=fs, unlabeled=unlabeled)
