"""Where data files are looked for: the data directories and the download cache.

* :func:`default_data_dirs`: ``$FMTL_DATA_DIR`` (if set and non-empty), ``<cwd>/../shared/data``
  and ``<repository root>/../shared/data``, recomputed on every call.
* :func:`default_cache_dir`: where :func:`~fmtl_flower.data.download.download_dataset` puts
  what it downloads when no ``cache_dir`` is given: ``$FMTL_CACHE_DIR`` if set and non-empty,
  else ``~/.cache/fmtl-flower``. Local copies of the paper datasets are looked for there too,
  after the data directories.

Nothing here touches the network or creates directories.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_DIR_ENV", "DATA_DIR_ENV", "default_cache_dir", "default_data_dirs"]

#: Environment variable naming a directory that holds the data files.
DATA_DIR_ENV = "FMTL_DATA_DIR"

#: Environment variable naming the download cache directory.
CACHE_DIR_ENV = "FMTL_CACHE_DIR"


def default_data_dirs() -> tuple[Path, ...]:
    """Directories searched for named data files, in resolution order.

    Returns
    -------
    tuple of Path
        ``$FMTL_DATA_DIR`` (if set and non-empty), ``<cwd>/../shared/data`` and
        ``<repository root>/../shared/data``, as absolute paths without duplicates. The
        directories need not exist.
    """
    candidates: list[Path] = []
    env = os.environ.get(DATA_DIR_ENV, "")
    if env:
        candidates.append(Path(env).expanduser())
    try:
        candidates.append(Path.cwd() / ".." / "shared" / "data")
    except OSError:  # the working directory was deleted
        pass
    # parents: [0] data/, [1] fmtl_flower/, [2] repository root, [3] its parent.
    candidates.append(Path(__file__).resolve().parents[3] / "shared" / "data")
    unique: list[Path] = []
    for c in candidates:
        c = c.resolve()
        if c not in unique:
            unique.append(c)
    return tuple(unique)


def default_cache_dir() -> Path:
    """The download cache: ``$FMTL_CACHE_DIR`` if set and non-empty, else ``~/.cache/fmtl-flower``.

    Returns
    -------
    Path
        An absolute path; the directory need not exist.
    """
    env = os.environ.get(CACHE_DIR_ENV, "")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "fmtl-flower"
    return base.resolve()
