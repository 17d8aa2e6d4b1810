"""Atomic, pickle-free state files: server checkpoints and device state.

A state file is one ``.npz`` holding named float/int arrays plus a JSON document (stored as
the uint8 array ``__meta__``), read back with ``allow_pickle=False``: nothing in it can run
code. Files are written to a temporary name in the same directory, flushed to disk and renamed
over the target (``os.replace``), so a reader sees either the old file or the new one, never a
torn one, even if the writer is killed mid-write.

* Server checkpoints: :func:`write_checkpoint` puts ``round-000012.npz`` (the state after
  round 12) into a directory and keeps the newest ``keep`` of them; :func:`read_checkpoint`
  returns the newest readable one (a corrupt newest file is skipped with a warning).
* Device state: :func:`write_state_file` / :func:`read_state_file` for one task's committed
  local state (``client-state-dir``), keyed by task id by the caller.

This module does not import Flower.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._renamed import RENAMED

__all__ = ["FORMAT_VERSION", "Checkpoint", "CheckpointError", "check_fingerprint",
           "read_checkpoint",
           "read_state_file", "state_file_path", "write_checkpoint", "write_state_file"]

FORMAT_VERSION = 1
_META = "__meta__"
_NAME = re.compile(r"^round-(\d{6,})\.npz$")
_logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint or state file is unreadable or does not match the run."""


@dataclass(frozen=True)
class Checkpoint:
    """A server checkpoint: the state after ``server_round`` rounds."""

    server_round: int
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any]
    path: Path


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _check_arrays(arrays: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for key, value in arrays.items():
        if not isinstance(key, str) or not key or key == _META:
            raise ValueError(f"bad array name {key!r}")
        array = np.asarray(value)
        if array.dtype.kind not in "biuf":
            raise ValueError(f"array {key!r} has dtype {array.dtype}; only bool, int and float "
                             "arrays are stored")
        out[key] = array
    return out


def write_state_file(path: str | Path, arrays: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write ``arrays`` and the JSON-serialisable ``meta`` to ``path`` atomically.

    Parameters
    ----------
    path : str or Path
        Target ``.npz`` file; its directory is created if needed.
    arrays : dict of str to array-like
        Numeric arrays (bool, int or float).
    meta : dict
        JSON-serialisable values (no NaN or infinity); ``format`` is added.

    Returns
    -------
    Path
        The file written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = _check_arrays(arrays)
    text = json.dumps({**meta, "format": FORMAT_VERSION}, allow_nan=False, sort_keys=True)
    payload[_META] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def read_state_file(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read a file written by :func:`write_state_file`: ``(arrays, meta)``.

    Raises
    ------
    CheckpointError
        If the file is missing, truncated, not an npz of numeric arrays, or of another format.
    """
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise CheckpointError(f"{path}: unreadable state file ({err})") from None
    if _META not in arrays:
        raise CheckpointError(f"{path}: no metadata; not written by fmtl-flower")
    try:
        meta = json.loads(arrays.pop(_META).tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: bad metadata ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}: format {found!r}, expected {FORMAT_VERSION}")
    for key, array in arrays.items():
        if array.dtype.kind not in "biuf":
            raise CheckpointError(f"{path}: array {key!r} has dtype {array.dtype}")
    return arrays, meta


def state_file_path(directory: str | Path, kind: str, task_id: int) -> Path:
    """``directory/<kind>-task-<id>.npz``: where a device keeps one task's state."""
    if not re.fullmatch(r"[a-z][a-z0-9-]*", kind):
        raise ValueError(f"bad state kind {kind!r}")
    if isinstance(task_id, bool) or not isinstance(task_id, int | np.integer) or task_id < 0:
        raise ValueError(f"task id must be an int >= 0, got {task_id!r}")
    return Path(directory) / f"{kind}-task-{int(task_id)}.npz"


def write_checkpoint(directory: str | Path, server_round: int, arrays: dict[str, Any],
                     meta: dict[str, Any], keep: int = 2) -> Path:
    """Write the state after ``server_round`` rounds as ``round-NNNNNN.npz``; keep the newest
    ``keep`` checkpoints (older ones are deleted after the new one is in place)."""
    if isinstance(server_round, bool) or not isinstance(server_round, int) or server_round < 0:
        raise ValueError(f"server_round must be an int >= 0, got {server_round!r}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    directory = Path(directory)
    path = write_state_file(directory / f"round-{server_round:06d}.npz", arrays,
                            {**meta, "server_round": server_round})
    for old in _checkpoint_files(directory)[:-keep]:
        old[1].unlink(missing_ok=True)
    return path


def _checkpoint_files(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def check_fingerprint(checkpoint: Checkpoint, expected: dict[str, Any]) -> None:
    """:class:`CheckpointError` naming the differing settings unless ``checkpoint`` was
    written with the ``expected`` fingerprint (compared as stored: tuples are lists; a
    strategy's former class name, :data:`~fmtl_flower._renamed.RENAMED`, counts as its
    current one)."""
    expected = json.loads(json.dumps(expected))
    saved = dict(checkpoint.meta.get("fingerprint") or {})
    if saved.get("strategy") in RENAMED:  # written before the PEP 8 class names
        saved["strategy"] = RENAMED[saved["strategy"]]
    if saved == expected:
        return
    diff = sorted(k for k in set(expected) | set(saved) if saved.get(k) != expected.get(k))
    raise CheckpointError(
        f"{checkpoint.path} was written with other settings ({', '.join(diff)}: "
        f"{ {k: saved.get(k) for k in diff} } vs this run's "
        f"{ {k: expected.get(k) for k in diff} }); use another checkpoint directory")


def read_checkpoint(directory: str | Path) -> Checkpoint | None:
    """The newest readable checkpoint in ``directory``, or None if there is none.

    A newest file that cannot be read (e.g. a disk error) is skipped with a warning and the
    previous one is used; a file whose round disagrees with its name is an error.
    """
    directory = Path(directory)
    for server_round, path in reversed(_checkpoint_files(directory)):
        try:
            arrays, meta = read_state_file(path)
        except CheckpointError as err:
            _logger.warning("skipping unreadable checkpoint: %s", err)
            continue
        if meta.get("server_round") != server_round:
            raise CheckpointError(f"{path}: its round {meta.get('server_round')} does not "
                                  "match its name")
        return Checkpoint(server_round, arrays, meta, path)
    return None
