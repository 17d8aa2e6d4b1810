"""Vehicle Sensor (SensIT, Duarte & Hu 2004), one task per sensor node, AAV vs DW, as in MOCHA.

What MOCHA specifies (Smith et al. 2017, section 5.1 and Table 2): "Acoustic, seismic, and
infrared sensor data collected from a distributed network of 23 sensors ... Each instance is
described by 50 acoustic and 50 seismic features. We model each sensor as a separate task and
predict between AAV-type and DW-type vehicles"; 23 tasks, d = 100, 872..1,933 training
instances per task. It links http://www.ecs.umass.edu/~mduarte/Software.html for the data.

What is documented about the published files (Duarte's README of the SensIT/SITEX02 energy
files, ``energy.zip``, May 2003): the data "are organized by runs, nodes and modalities": one
directory per run, named ``AAV3`` .. ``AAV11`` and ``DW1`` .. ``DW12`` (the vehicle class is
the run's name prefix); inside it one directory per node, ``n1`` .. ``n6``, ``n41``, ``n42``,
``n46`` .. ``n56``, ``n58`` .. ``n61`` (23 nodes, as many as MOCHA's tasks), and per-node files
named ``<run>cpa<nn>_<m>.txt`` (energy) and ``<run>label<nn>.txt`` (detection labels), ``m`` the
modality (1 acoustic, 2 seismic, 3 PIR).

**Assumed** (no stored source pins down the per-node *feature* files MOCHA used; the same
organisation as the documented energy files is assumed)::

    <root>/                      a directory (``$FMTL_DATA_DIR/vehicle``) or a .zip/.tar.gz
      AAV3/ ... DW12/            one directory per run: AAV<k> or DW<k> (case-insensitive)
        n1/ ... n61/             one directory per node: n<NN>
          <run>feat<NN>_1.txt    acoustic feature vectors: 50 numbers per line
          <run>feat<NN>_2.txt    seismic feature vectors: 50 numbers per line, same line
                                 count; line i of both files describes the same event window

(the ``feat`` part and the line pairing are the assumption; change the file-name pattern with
``feature_file=``). Other files and directories (energy, label, timestamp files, the
``acoustic_1`` / ``seismic_2`` modality directories, other runs) are ignored.

Task ``t`` is the ``t``-th node by node number; its rows are the runs in order (AAV runs by
number, then DW runs by number), each in file order; ``X`` row = [50 acoustic | 50 seismic].
Label ``+1`` for AAV runs and ``-1`` for DW runs (MOCHA does not say which class is positive;
the hinge loss is symmetric in this choice).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Iterator

import numpy as np

from fmtl_flower.data.archive import FileTree, open_tree
from fmtl_flower.data.dataset import LoadedTasks
from fmtl_flower.data.download import locate_dataset
from fmtl_flower.data.textfiles import parse_table
from fmtl_flower.data.validation import loaded_tasks

__all__ = [
    "VEHICLE_FEATURE_FILE",
    "VEHICLE_FEATURES_PER_MODALITY",
    "VEHICLE_NODES",
    "load_vehicle_tasks",
]

#: Assumed file-name pattern of a node's feature file in a run (``modality`` 1 acoustic,
#: 2 seismic; ``node`` the number without the ``n``).
VEHICLE_FEATURE_FILE = "{run}feat{node}_{modality}.txt"

#: Features per modality (MOCHA: 50 acoustic and 50 seismic).
VEHICLE_FEATURES_PER_MODALITY = 50

#: The 23 SITEX02 node numbers listed in Duarte's README (for reference; any ``n<NN>`` found
#: is read).
VEHICLE_NODES: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 41, 42, *range(46, 57), 58, 59, 60, 61)

_MODALITIES = {1: "acoustic", 2: "seismic"}
_PATH_RE = re.compile(
    r"^(?P<prefix>(?:.*/)?)(?P<run>(?:AAV|DW)\d+)/n(?P<node>\d+)/(?P<file>[^/]+)$", re.IGNORECASE
)


def _run_key(run: str) -> tuple[int, int]:
    """AAV runs first, then DW runs, each by number."""
    m = re.match(r"([A-Za-z]+)(\d+)$", run)
    assert m is not None
    return (0 if m.group(1).upper() == "AAV" else 1, int(m.group(2)))


def _scan(tree: FileTree, feature_file: str) -> dict[int, dict[str, dict[int, str]]]:
    """node -> run -> modality -> member name, under the shortest matching prefix."""
    found: dict[str, dict[int, dict[str, dict[int, str]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(dict))
    )
    for name in tree.files:
        m = _PATH_RE.match(name)
        if m is None:
            continue
        run, node = m.group("run"), int(m.group("node"))
        for modality in _MODALITIES:
            expected = feature_file.format(run=run, node=m.group("node"), modality=modality)
            if m.group("file").lower() == expected.lower():
                found[m.group("prefix")][node][run][modality] = name
    if not found:
        return {}
    prefix = min(found, key=len)
    return found[prefix]


def _load_tree(tree: FileTree, feature_file: str) -> LoadedTasks:
    nodes = _scan(tree, feature_file)
    if not nodes:
        example = feature_file.format(run="AAV3", node="1", modality=1)
        raise FileNotFoundError(
            f"{tree.label}: no Vehicle feature files found; expected <run>/n<NN>/{feature_file} "
            f"(e.g. AAV3/n1/{example}) with run AAV<k> or DW<k>; see fmtl_flower.data.vehicle"
        )
    return loaded_tasks(_node_tasks(tree, feature_file, nodes), name=tree.label,
                        empty="the Vehicle feature files hold no rows")


def _node_tasks(tree: FileTree, feature_file: str, nodes: dict) -> Iterator[tuple]:
    """Every node with rows: ``(X, y, where, name)`` as :func:`loaded_tasks` reads them."""
    d = VEHICLE_FEATURES_PER_MODALITY
    for node in sorted(nodes):
        blocks, labels = [], []
        for run in sorted(nodes[node], key=_run_key):
            files = nodes[node][run]
            missing = [_MODALITIES[k] for k in _MODALITIES if k not in files]
            if missing:
                have = next(iter(files.values()))
                raise FileNotFoundError(
                    f"{tree.where(have)}: run {run}, node n{node} has no {' / '.join(missing)} "
                    f"feature file ({feature_file.format(run=run, node=node, modality=2)!r})"
                )
            acoustic = parse_table(tree.read_text(files[1]), tree.where(files[1]), ncols=d)
            seismic = parse_table(tree.read_text(files[2]), tree.where(files[2]), ncols=d)
            if acoustic.shape[0] != seismic.shape[0]:
                raise ValueError(
                    f"{tree.label}: run {run}, node n{node}: {acoustic.shape[0]} acoustic rows "
                    f"but {seismic.shape[0]} seismic rows; each line must pair the same event"
                )
            blocks.append(np.hstack([acoustic, seismic]))
            label = 1.0 if _run_key(run)[0] == 0 else -1.0
            labels.append(np.full(acoustic.shape[0], label))
        X = np.vstack(blocks)
        if X.shape[0] == 0:
            continue
        yield X, np.concatenate(labels), f"{tree.label}: n{node}", f"n{node}"


def load_vehicle_tasks(
    path: str | os.PathLike[str] | None = None,
    *,
    download: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    feature_file: str = VEHICLE_FEATURE_FILE,
) -> LoadedTasks:
    """Read the Vehicle Sensor features as one task per node, label +1 AAV / -1 DW.

    The expected layout (partly assumed) is described in :mod:`fmtl_flower.data.vehicle`.

    Parameters
    ----------
    path : str or os.PathLike, optional
        A local copy (directory, ``.zip`` or ``.tar.gz``); default: looked for by
        :func:`~fmtl_flower.data.download.locate_dataset` (``$FMTL_DATA_DIR/vehicle``,
        ``vehicle.zip``, ..., then the cache).
    download : bool, default False
        If no local copy is found, download one first. No published URL is known for these
        files, so this raises unless a copy was put in the cache with
        ``download_dataset("vehicle", url=...)``.
    cache_dir : str or os.PathLike, optional
        Cache directory to search.
    feature_file : str, default ``"{run}feat{node}_{modality}.txt"``
        File-name pattern of a node's feature file in a run directory (``run`` e.g. ``AAV3``,
        ``node`` the number, ``modality`` 1 acoustic / 2 seismic); compared case-insensitively.

    Returns
    -------
    LoadedTasks
        ``Xs`` (each ``(n_t, 100)``: 50 acoustic then 50 seismic features), ``ys`` in
        ``{-1, +1}``, ``task_names`` (``"n<NN>"``), tasks by node number.

    Raises
    ------
    FileNotFoundError
        No local copy (the message lists where it looked and how to get it), no feature file
        in the expected layout, or a run/node with only one of the two modalities.
    ValueError
        A malformed feature file (named, with the line), or acoustic and seismic files of a
        run/node with different line counts.
    """
    where = locate_dataset("vehicle", path, download=download, cache_dir=cache_dir)
    with open_tree(where) as tree:
        return _load_tree(tree, feature_file)
