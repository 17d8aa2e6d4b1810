"""UCI Human Activity Recognition Using Smartphones (Anguita et al. 2013), as in MOCHA.

MOCHA (Smith et al. 2017, section 5.1): "We use the provided 561-length feature vectors of
time and frequency domain variables generated for each instance [3]. We model each individual
as a separate task and predict between sitting and the other activities." This loader does
exactly that, on the published files:

* Layout (``UCI HAR Dataset/`` in UCI's archive ``UCI HAR Dataset.zip``, itself inside
  ``human+activity+recognition+using+smartphones.zip`` on the current UCI site)::

      UCI HAR Dataset/
        activity_labels.txt        "1 WALKING" ... "4 SITTING" ... "6 LAYING"
        train/X_train.txt          one window per line: 561 space-separated numbers
        train/y_train.txt          activity code 1..6, one per line
        train/subject_train.txt    subject 1..30, one per line
        test/X_test.txt, test/y_test.txt, test/subject_test.txt   (same formats)

  (``features.txt``, ``README.txt`` and ``Inertial Signals/`` are not needed.)
* The published train/test parts (21 and 9 disjoint subjects) are pooled, train rows first,
  each in file order; task ``t`` is the ``t``-th smallest subject id (30 tasks for the full
  data), so the project's own per-task split (``load_dataset``) applies to every subject.
* Label ``+1`` for SITTING, ``-1`` for the five other activities. The SITTING code is read
  from ``activity_labels.txt`` when present (it is 4 in the published file), else 4.

Nothing here is approximated. MOCHA's Table 2 gives 210..306 training windows per task for a
75/25 split, i.e. about 280..409 windows per subject in all; ``load_dataset("har",
test_frac=0.25)`` splits the same pooled per-subject data (its per-class rounding may differ
from the paper's by a window).
"""

from __future__ import annotations

import os

import numpy as np

from fmtl_flower.data.archive import FileTree, open_tree
from fmtl_flower.data.dataset import LoadedTasks
from fmtl_flower.data.download import locate_dataset
from fmtl_flower.data.textfiles import parse_int_column, parse_table
from fmtl_flower.data.validation import loaded_tasks

__all__ = ["HAR_NUM_FEATURES", "HAR_SITTING", "load_har_tasks"]

#: Length of the published feature vectors.
HAR_NUM_FEATURES = 561

#: Activity code of SITTING in the published ``activity_labels.txt``.
HAR_SITTING = 4

_PARTS = ("train", "test")


def _find_root(tree: FileTree) -> str | None:
    """The prefix (``""`` or ``"<dir>/"``) under which ``train/X_train.txt`` lies, shortest."""
    roots = [
        f[: -len("train/X_train.txt")]
        for f in tree.files
        if f == "train/X_train.txt" or f.endswith("/train/X_train.txt")
    ]
    return min(roots, key=len) if roots else None


def _sitting_code(tree: FileTree, root: str) -> int:
    name = f"{root}activity_labels.txt"
    if name not in tree.files:
        return HAR_SITTING
    for lineno, line in enumerate(tree.read_text(name).splitlines(), start=1):
        fields = line.split()
        if len(fields) >= 2 and fields[1].upper() == "SITTING":
            try:
                return int(fields[0])
            except ValueError:
                raise ValueError(
                    f"{tree.where(name)}: line {lineno}: bad activity code {fields[0]!r}"
                ) from None
    raise ValueError(f"{tree.where(name)}: no SITTING activity listed")


def _read_part(tree: FileTree, root: str, part: str) -> tuple[np.ndarray, ...]:
    names = {k: f"{root}{part}/{k}_{part}.txt" for k in ("X", "y", "subject")}
    missing = [n for n in names.values() if n not in tree.files]
    if missing:
        raise FileNotFoundError(
            f"{tree.label}: incomplete UCI HAR copy, missing {', '.join(missing)}"
        )
    X = parse_table(tree.read_text(names["X"]), tree.where(names["X"]), ncols=HAR_NUM_FEATURES)
    y = parse_int_column(tree.read_text(names["y"]), tree.where(names["y"]))
    s = parse_int_column(tree.read_text(names["subject"]), tree.where(names["subject"]))
    if not (X.shape[0] == y.shape[0] == s.shape[0]):
        raise ValueError(
            f"{tree.label}: {part} part has {X.shape[0]} rows in X_{part}.txt, {y.shape[0]} in "
            f"y_{part}.txt and {s.shape[0]} in subject_{part}.txt; they must be equal"
        )
    if X.shape[0] == 0:
        raise ValueError(f"{tree.where(names['X'])}: no rows")
    bad_y = (y < 1) | (y > 6)
    if bad_y.any():
        found = sorted({int(v) for v in y[bad_y]})
        raise ValueError(f"{tree.where(names['y'])}: activity codes must be 1..6, found {found}")
    if (s < 1).any():
        raise ValueError(f"{tree.where(names['subject'])}: subject ids must be positive")
    return X, y, s


def _load_tree(tree: FileTree) -> LoadedTasks:
    root = _find_root(tree)
    if root is None:
        nested = [f for f in tree.files if f.rsplit("/", 1)[-1] == "UCI HAR Dataset.zip"]
        if nested:
            with tree.open_nested(nested[0]) as inner:
                return _load_tree(inner)
        raise FileNotFoundError(
            f"{tree.label}: no train/X_train.txt found; expected the published "
            "'UCI HAR Dataset' layout (train/ and test/ with X_, y_ and subject_ files)"
        )
    sitting = _sitting_code(tree, root)
    parts = [_read_part(tree, root, part) for part in _PARTS]
    X = np.vstack([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    s = np.concatenate([p[2] for p in parts])

    def subjects():
        for subject in np.unique(s):
            rows = s == subject
            yield (X[rows], np.where(y[rows] == sitting, 1.0, -1.0),
                   f"{tree.label}: subject {subject}", f"subject {subject}")

    return loaded_tasks(subjects(), name=tree.label)


def load_har_tasks(
    path: str | os.PathLike[str] | None = None,
    *,
    download: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
) -> LoadedTasks:
    """Read UCI HAR as one task per subject, label +1 for SITTING and -1 otherwise.

    Parameters
    ----------
    path : str or os.PathLike, optional
        A local copy: the ``UCI HAR Dataset`` directory, ``UCI HAR Dataset.zip``, or UCI's
        outer ``human+activity+recognition+using+smartphones.zip``. Default: looked for by
        :func:`~fmtl_flower.data.download.locate_dataset` (``$FMTL_DATA_DIR/UCI HAR Dataset``
        and the other candidates, then the cache).
    download : bool, default False
        If no local copy is found, download it into the cache first (network needed).
    cache_dir : str or os.PathLike, optional
        Cache directory to search and download into.

    Returns
    -------
    LoadedTasks
        ``Xs`` (each ``(n_t, 561)``), ``ys`` in ``{-1, +1}``, ``task_names``
        (``"subject <id>"``), tasks in increasing subject id.

    Raises
    ------
    FileNotFoundError
        No local copy (the message lists where it looked and how to download), or a copy
        missing one of the six data files.
    ValueError
        A malformed file (the message names the file and line): wrong column count,
        non-numeric value, row counts that differ between X, y and subject, activity codes
        outside 1..6.
    """
    where = locate_dataset("har", path, download=download, cache_dir=cache_dir)
    with open_tree(where) as tree:
        return _load_tree(tree)
