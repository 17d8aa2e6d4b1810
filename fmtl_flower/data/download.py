"""Local copies of the MOCHA paper's datasets, and downloading them into a cache on request.

Nothing is ever downloaded implicitly: :func:`locate_dataset` (used by every loader) only
downloads when called with ``download=True``, and :func:`download_dataset` is the one
function that opens a network connection (``urllib.request.urlopen``, or an ``opener`` the
caller passes, e.g. a fake one in tests).

Where a local copy is looked for, in order (:func:`candidate_paths`):

1. a path the caller gives (``path=`` / ``data_path=``), used as is;
2. in each of :func:`~fmtl_flower.data.paths.default_data_dirs` (``$FMTL_DATA_DIR`` first),
   then in the cache directory (``cache_dir`` or
   :func:`~fmtl_flower.data.paths.default_cache_dir`), each of the dataset's
   :attr:`DatasetSource.local_names` (for example ``UCI HAR Dataset`` then
   ``UCI HAR Dataset.zip`` for ``har``).

What :func:`download_dataset` does, for ``name`` in :data:`SOURCES`:

1. fetch the archive (each known URL in turn, or the ``url`` given) into
   ``<cache>/.<file>.part``, computing its SHA-256 / MD5 while streaming;
2. check it against the published checksum when one is known (a mismatch deletes the
   partial file and raises);
3. unpack it safely (:func:`~fmtl_flower.data.archive.extract_archive`) into a temporary
   directory in the cache, unpack a nested archive if the source says so (UCI's
   ``human+activity+recognition+using+smartphones.zip`` holds ``UCI HAR Dataset.zip``), and
   move the dataset's root to ``<cache>/<target>`` (``UCI HAR Dataset``, ``GLEAM`` or
   ``vehicle``), which is the first name the loaders look for;
4. delete the archive and the temporary directory.

A dataset already present in the cache is not downloaded again unless ``force=True``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from fmtl_flower.data.archive import archive_kind, extract_archive
from fmtl_flower.data.paths import DATA_DIR_ENV, default_cache_dir, default_data_dirs

__all__ = [
    "SOURCES",
    "DatasetSource",
    "Mirror",
    "candidate_paths",
    "download_dataset",
    "locate_dataset",
]

log = logging.getLogger(__name__)

_CHUNK = 1 << 20

#: Type of the ``opener`` argument: ``opener(url, timeout=...)`` returns a readable binary
#: file object (``urllib.request.urlopen`` is one).
Opener = Callable[..., IO[bytes]]


@dataclass(frozen=True)
class Mirror:
    """One download URL of a published archive and its checksums (checked when known).

    Parameters
    ----------
    url : str
        Direct download URL.
    sha256, md5 : str, optional
        Hex digests the downloaded file must have.
    """

    url: str
    sha256: str | None = None
    md5: str | None = None


@dataclass(frozen=True)
class DatasetSource:
    """Where a paper dataset comes from and how a local copy is named.

    Parameters
    ----------
    name : str
        Registry name (``"har"``, ``"vehicle"``, ``"gleam"``).
    title : str
        Human-readable title, for messages.
    homepage : str
        Page that describes the dataset and its download.
    mirrors : tuple of Mirror
        Direct downloads of the published archive, tried in order while they fail to connect
        (a checksum mismatch stops at once); empty when no direct download is known: then
        :func:`download_dataset` needs ``url=``.
    archive : str
        File name of the downloaded archive (its suffix tells zip from tar).
    nested : str or None
        Name (basename) of an archive inside the downloaded one that holds the data.
    target : str
        Directory name of the unpacked copy in the cache; also the first of ``local_names``.
    local_names : tuple of str
        Names (directories or archives) a local copy may have inside a data directory.
    marker : str or None
        POSIX path suffix of a file that identifies the dataset's root inside an unpacked
        archive (``"train/X_train.txt"`` for HAR); None: the unpacked directory itself (or
        its single top-level directory) is the root.
    """

    name: str
    title: str
    homepage: str
    mirrors: tuple[Mirror, ...]
    archive: str
    nested: str | None
    target: str
    local_names: tuple[str, ...]
    marker: str | None


#: The published sources. HAR: the SHA-256 digests of UCI's current archive and of the
#: ``UCI HAR Dataset.zip`` it holds (the file the older URL serves), as pinned by third-party
#: scripts that verify them; GLEAM: the MD5 that torchvision-based loaders check
#: (``vaseline555/Federated-Learning-in-PyTorch``, ``src/datasets/gleam.py``). No direct
#: download of the per-sensor Vehicle feature files is known (see
#: :mod:`fmtl_flower.data.vehicle`), so ``vehicle`` needs an explicit ``url=``.
SOURCES: dict[str, DatasetSource] = {
    "har": DatasetSource(
        name="har",
        title="UCI Human Activity Recognition Using Smartphones",
        homepage="https://archive.ics.uci.edu/dataset/240/human+activity+recognition+using+smartphones",
        mirrors=(
            Mirror(
                "https://archive.ics.uci.edu/static/public/240/"
                "human+activity+recognition+using+smartphones.zip",
                sha256="c00b803081a5c797cd5e4b83700a9810b38d53d9d84e01917e090e1fdbc81031",
            ),
            Mirror(
                "https://archive.ics.uci.edu/ml/machine-learning-databases/00240/"
                "UCI%20HAR%20Dataset.zip",
                sha256="2045e435c955214b38145fb5fa00776c72814f01b203fec405152dac7d5bfeb0",
            ),
        ),
        archive="human+activity+recognition+using+smartphones.zip",
        nested="UCI HAR Dataset.zip",
        target="UCI HAR Dataset",
        local_names=(
            "UCI HAR Dataset",
            "UCI HAR Dataset.zip",
            "human+activity+recognition+using+smartphones.zip",
        ),
        marker="train/X_train.txt",
    ),
    "gleam": DatasetSource(
        name="gleam",
        title="GLEAM (Glass Eating and Motion), Rahman et al. 2015",
        homepage="http://www.skleinberg.org/data.html",
        mirrors=(
            Mirror(
                "http://www.skleinberg.org/data/GLEAM.tar.gz",
                md5="10ad34716546e44c5078d392f25031e1",
            ),
        ),
        archive="GLEAM.tar.gz",
        nested=None,
        target="GLEAM",
        local_names=("GLEAM", "GLEAM.tar.gz", "gleam"),
        marker=None,
    ),
    "vehicle": DatasetSource(
        name="vehicle",
        title="Vehicle Sensor (SensIT, Duarte & Hu 2004), per-sensor features",
        homepage="http://www.ecs.umass.edu/~mduarte/Software.html",
        mirrors=(),
        archive="vehicle.zip",
        nested=None,
        target="vehicle",
        local_names=("vehicle", "vehicle.zip", "vehicle.tar.gz", "vehicle.tgz"),
        marker=None,
    ),
}


def _source(name: str) -> DatasetSource:
    try:
        return SOURCES[name]
    except KeyError:
        raise ValueError(
            f"no download source for dataset {name!r}; known: {sorted(SOURCES)}"
        ) from None


def candidate_paths(name: str, cache_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Every path a local copy of ``name`` is looked for at, in order.

    Parameters
    ----------
    name : str
        A key of :data:`SOURCES`.
    cache_dir : str or os.PathLike, optional
        The cache directory (default :func:`~fmtl_flower.data.paths.default_cache_dir`).

    Returns
    -------
    list of Path
        ``<dir>/<local name>`` for each data directory then the cache, without duplicates.
    """
    src = _source(name)
    cache = Path(cache_dir).expanduser().resolve() if cache_dir is not None else default_cache_dir()
    dirs = [*default_data_dirs(), cache]
    out: list[Path] = []
    for d in dirs:
        for local in src.local_names:
            p = d / local
            if p not in out:
                out.append(p)
    return out


def _how_to_get(src: DatasetSource) -> str:
    if src.mirrors:
        how = (
            f"download it explicitly with fmtl_flower.data.download_dataset({src.name!r}, "
            f"cache_dir=...) (or load_dataset({src.name!r}, download=True)), or get it from "
            f"{src.mirrors[0].url} yourself"
        )
    else:
        how = (
            f"no direct download is known: get it from {src.homepage} and arrange it as "
            f"fmtl_flower.data.{src.name} documents, or call "
            f"fmtl_flower.data.download_dataset({src.name!r}, url=..., cache_dir=...) with "
            "an archive in that layout"
        )
    return (
        f"{how}; then set {DATA_DIR_ENV} to the directory that holds "
        f"{' or '.join(repr(n) for n in src.local_names)}, or pass the path"
    )


def locate_dataset(
    name: str,
    path: str | os.PathLike[str] | None = None,
    *,
    download: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Find the local copy of a paper dataset, downloading it only if ``download=True``.

    Parameters
    ----------
    name : str
        A key of :data:`SOURCES`.
    path : str or os.PathLike, optional
        An explicit local copy (directory or archive); no other place is looked at.
    download : bool, default False
        When no local copy is found, call :func:`download_dataset` (network needed).
    cache_dir : str or os.PathLike, optional
        Cache directory searched (after the data directories) and downloaded into.

    Returns
    -------
    Path
        The directory or archive to read.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist, or no copy is found and ``download`` is False; the
        message lists every path looked at and how to get the data.
    """
    src = _source(name)
    if path is not None:
        p = Path(path).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"{src.title}: {p} does not exist; {_how_to_get(src)}")
        return p
    tried = candidate_paths(name, cache_dir)
    for candidate in tried:
        if candidate.exists():
            return candidate
    if download:
        return download_dataset(name, cache_dir=cache_dir)
    looked = "\n  ".join(str(p) for p in tried)
    raise FileNotFoundError(
        f"no local copy of {src.title} ({name!r}); looked for:\n  {looked}\n{_how_to_get(src)}"
    )


def _fetch(url: str, dest: Path, opener: Opener, timeout: float) -> tuple[str, str]:
    """Stream ``url`` into ``dest``; return its (sha256, md5) hex digests."""
    sha = hashlib.sha256()
    md5 = hashlib.md5(usedforsecurity=False)
    with opener(url, timeout=timeout) as response, open(dest, "wb") as out:
        while True:
            chunk = response.read(_CHUNK)
            if not chunk:
                break
            sha.update(chunk)
            md5.update(chunk)
            out.write(chunk)
    return sha.hexdigest(), md5.hexdigest()


def _find_root(unpacked: Path, marker: str | None) -> Path | None:
    """The dataset root inside an unpacked tree: the shortest prefix of ``marker``."""
    if marker is None:
        entries = [e for e in unpacked.iterdir() if e.name != "__MACOSX"]
        if len(entries) == 1 and entries[0].is_dir():
            return entries[0]
        return unpacked
    suffix = PurePosixPath(marker).parts
    best: Path | None = None
    for dirpath, _dirs, files in os.walk(unpacked):
        if "__MACOSX" in Path(dirpath).parts:
            continue
        for f in files:
            full = Path(dirpath) / f
            parts = full.relative_to(unpacked).parts
            if len(parts) >= len(suffix) and parts[-len(suffix) :] == suffix:
                root = unpacked.joinpath(*parts[: -len(suffix)])
                if best is None or len(root.parts) < len(best.parts):
                    best = root
    return best


def download_dataset(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    url: str | None = None,
    sha256: str | None = None,
    opener: Opener | None = None,
    timeout: float = 60.0,
    force: bool = False,
) -> Path:
    """Download a paper dataset into the cache and unpack it (only ever called explicitly).

    Parameters
    ----------
    name : str
        ``"har"``, ``"gleam"`` or ``"vehicle"`` (a key of :data:`SOURCES`).
    cache_dir : str or os.PathLike, optional
        Where to put it (created if needed); default
        :func:`~fmtl_flower.data.paths.default_cache_dir` (``$FMTL_CACHE_DIR`` or
        ``~/.cache/fmtl-flower``).
    url : str, optional
        Download this archive instead of the published URLs (required for ``"vehicle"``).
        Its checksum is then only checked if ``sha256`` is given.
    sha256 : str, optional
        Expected SHA-256 of the archive at ``url``.
    opener : callable, optional
        ``opener(url, timeout=...)`` returning a binary file object; default
        ``urllib.request.urlopen`` (looked up at call time).
    timeout : float, default 60.0
        Socket timeout in seconds for each URL.
    force : bool, default False
        Download again even if ``<cache>/<target>`` exists (it is replaced).

    Returns
    -------
    Path
        ``<cache>/<target>``: the unpacked dataset (``UCI HAR Dataset``, ``GLEAM`` or
        ``vehicle``), in the layout its loader reads.

    Raises
    ------
    ValueError
        Unknown name, no URL known for ``"vehicle"`` and none given, a checksum mismatch, an
        unreadable or unsafe archive, or an archive without the expected content.
    OSError
        If every URL failed (the message lists each URL and its error) or the cache is not
        writable.
    """
    src = _source(name)
    cache = Path(cache_dir).expanduser().resolve() if cache_dir is not None else default_cache_dir()
    final = cache / src.target
    if final.exists() and not force:
        log.info("%s: already in the cache at %s", name, final)
        return final
    mirrors, archive = _mirrors_and_archive(name, src, url, sha256)
    open_url = opener if opener is not None else urllib.request.urlopen
    cache.mkdir(parents=True, exist_ok=True)
    part = cache / f".{archive}.part"
    _download_first(name, mirrors, part, open_url, timeout)
    archive_path = cache / archive
    os.replace(part, archive_path)
    try:
        _unpack(name, src, archive_path, final)
    finally:
        archive_path.unlink(missing_ok=True)
    log.info("%s: unpacked into %s", name, final)
    return final


def _mirrors_and_archive(name: str, src: DatasetSource, url: str | None,
                         sha256: str | None) -> tuple[tuple[Mirror, ...], str]:
    """The URLs to try and the archive's file name (from ``url`` when it tells the type)."""
    archive = src.archive
    if url is not None:
        mirrors: tuple[Mirror, ...] = (Mirror(url, sha256=sha256),)
        tail = PurePosixPath(url.split("?", 1)[0]).name
        if archive_kind(tail) is not None:
            archive = tail
    else:
        if not src.mirrors:
            raise ValueError(f"{src.title}: {_how_to_get(src)}")
        mirrors = src.mirrors
    if archive_kind(archive) is None:
        raise ValueError(f"{name}: cannot tell the archive type of {archive!r} (.zip or .tar.gz)")
    return mirrors, archive


def _download_first(name: str, mirrors: tuple[Mirror, ...], part: Path, open_url: Opener,
                    timeout: float) -> None:
    """Fetch the first mirror that answers into ``part`` and check its checksums.

    A failing URL is skipped (an OSError lists every URL when all fail); a checksum
    mismatch is a ValueError at once.
    """
    errors: list[str] = []
    for mirror in mirrors:
        u = mirror.url
        log.info("%s: downloading %s", name, u)
        try:
            got_sha, got_md5 = _fetch(u, part, open_url, timeout)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            part.unlink(missing_ok=True)
            errors.append(f"{u}: {exc}")
            continue
        mismatch = [
            f"{kind} {got} (expected {want})"
            for kind, got, want in (
                ("SHA-256", got_sha, mirror.sha256),
                ("MD5", got_md5, mirror.md5),
            )
            if want is not None and got.lower() != want.lower()
        ]
        if mismatch:
            part.unlink(missing_ok=True)
            raise ValueError(f"{name}: checksum mismatch for {u}: {'; '.join(mismatch)}")
        return
    raise OSError(f"{name}: download failed (offline?); tried:\n  " + "\n  ".join(errors))


def _unpack(name: str, src: DatasetSource, archive_path: Path, final: Path) -> None:
    """Unpack ``archive_path`` (and its nested archive, if any) in a scratch folder beside
    it and move the dataset's root (the folder holding ``src.marker``) to ``final``."""
    work = Path(tempfile.mkdtemp(prefix=f".{name}-unpack-", dir=archive_path.parent))
    try:
        extract_archive(archive_path, work / "outer")
        unpacked = work / "outer"
        if src.nested is not None:
            inner = next(
                (p for p in sorted(unpacked.rglob(src.nested)) if "__MACOSX" not in p.parts),
                None,
            )
            if inner is not None:
                extract_archive(inner, work / "inner")
                unpacked = work / "inner"
        root = _find_root(unpacked, src.marker)
        if root is None:
            raise ValueError(
                f"{name}: the downloaded archive holds no {src.marker!r}; not {src.title}?"
            )
        if final.exists():
            shutil.rmtree(final) if final.is_dir() else final.unlink()
        shutil.move(str(root), str(final))
    finally:
        shutil.rmtree(work, ignore_errors=True)
