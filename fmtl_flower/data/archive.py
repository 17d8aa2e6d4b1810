"""Read a dataset the same way whether it is a directory, a ``.zip`` or a ``.tar(.gz)`` file.

:func:`open_tree` returns a :class:`FileTree`: the sorted list of the regular files it holds
(POSIX paths relative to its root, macOS metadata such as ``__MACOSX/`` and ``._*`` left out)
and a way to read one of them. Loaders find their files by path pattern in that list, so a
published archive can be read without unpacking it.

:func:`extract_archive` unpacks a ``.zip`` / ``.tar(.gz)`` file safely (regular files and
directories only; no absolute paths, no ``..``, no links), for the download cache.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

__all__ = ["FileTree", "archive_kind", "extract_archive", "open_tree"]

_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")


def archive_kind(name: str | os.PathLike[str]) -> str | None:
    """``"zip"``, ``"tar"`` or None, from the file name's suffix (case-insensitive)."""
    lower = str(name).lower()
    if lower.endswith(".zip"):
        return "zip"
    if lower.endswith(_TAR_SUFFIXES):
        return "tar"
    return None


def _is_metadata(name: str) -> bool:
    """True for macOS archive clutter (``__MACOSX/``, ``._*`` resource forks, ``.DS_Store``)."""
    parts = PurePosixPath(name).parts
    return (
        any(p == "__MACOSX" for p in parts)
        or parts[-1].startswith("._")
        or (parts[-1] == ".DS_Store")
    )


class FileTree:
    """The regular files of a directory or an archive, readable by relative POSIX path.

    Use :func:`open_tree` to make one; use it as a context manager (or call :meth:`close`) to
    release an open archive.

    Attributes
    ----------
    label : str
        What the tree was opened from (a path, or ``"<archive> :: <member>"`` for a nested
        archive); used in error messages.
    files : list of str
        Relative POSIX paths of the regular files, sorted.
    """

    def __init__(self, label: str, files: list[str]) -> None:
        self.label = label
        self.files = sorted(f for f in files if not _is_metadata(f))

    def read_bytes(self, name: str) -> bytes:  # pragma: no cover - overridden
        raise NotImplementedError

    def read_head(self, name: str, size: int) -> bytes:
        """The first ``size`` bytes of the file ``name`` (default: read it all and cut)."""
        return self.read_bytes(name)[:size]

    def read_text(self, name: str) -> str:
        """The file ``name`` decoded as UTF-8 (undecodable bytes replaced)."""
        return self.read_bytes(name).decode("utf-8", errors="replace")

    def where(self, name: str) -> str:
        """``name`` located for an error message: ``<label>/<name>`` or ``<label> :: <name>``."""
        return f"{self.label}/{name}"

    def open_nested(self, name: str) -> FileTree:
        """Open the member ``name``, itself a ``.zip`` or ``.tar(.gz)``, as a tree (in memory)."""
        data = self.read_bytes(name)
        label = f"{self.where(name)}"
        kind = archive_kind(name)
        try:
            if kind == "zip":
                return _ZipTree(zipfile.ZipFile(io.BytesIO(data)), label)
            if kind == "tar":
                return _TarTree(tarfile.open(fileobj=io.BytesIO(data), mode="r:*"), label)
        except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError) as exc:
            raise ValueError(f"{label}: not a readable archive ({exc})") from exc
        raise ValueError(f"{label}: not a .zip or .tar(.gz) archive")

    def close(self) -> None:
        """Release the underlying archive (nothing to do for a directory)."""

    def __enter__(self) -> FileTree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _DirTree(FileTree):
    def __init__(self, root: Path) -> None:
        self.root = root
        files = []
        for dirpath, _dirnames, filenames in os.walk(root):
            for f in filenames:
                full = Path(dirpath) / f
                if full.is_file():
                    files.append(full.relative_to(root).as_posix())
        super().__init__(str(root), files)

    def read_bytes(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def read_head(self, name: str, size: int) -> bytes:
        with open(self.root / name, "rb") as fh:
            return fh.read(size)


class _ZipTree(FileTree):
    def __init__(self, zf: zipfile.ZipFile, label: str) -> None:
        self._zf = zf
        super().__init__(label, [i.filename for i in zf.infolist() if not i.is_dir()])

    def read_bytes(self, name: str) -> bytes:
        try:
            return self._zf.read(name)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            raise ValueError(f"{self.where(name)}: cannot read the archive member ({exc})") from exc

    def read_head(self, name: str, size: int) -> bytes:
        try:
            with self._zf.open(name) as fh:
                return fh.read(size)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            raise ValueError(f"{self.where(name)}: cannot read the archive member ({exc})") from exc

    def where(self, name: str) -> str:
        return f"{self.label} :: {name}"

    def close(self) -> None:
        self._zf.close()


class _TarTree(FileTree):
    def __init__(self, tf: tarfile.TarFile, label: str) -> None:
        self._tf = tf
        self._members = {m.name: m for m in tf.getmembers() if m.isfile()}
        super().__init__(label, list(self._members))

    def read_bytes(self, name: str) -> bytes:
        try:
            fh = self._tf.extractfile(self._members[name])
            assert fh is not None
            return fh.read()
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise ValueError(f"{self.where(name)}: cannot read the archive member ({exc})") from exc

    def where(self, name: str) -> str:
        return f"{self.label} :: {name}"

    def close(self) -> None:
        self._tf.close()


def open_tree(path: str | os.PathLike[str]) -> FileTree:
    """Open a directory, ``.zip`` or ``.tar(.gz)`` file as a :class:`FileTree`.

    Parameters
    ----------
    path : str or os.PathLike
        An existing directory or archive.

    Returns
    -------
    FileTree

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        If ``path`` is a file that is not a readable ``.zip`` / ``.tar(.gz)`` archive.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        return _DirTree(p)
    if not p.exists():
        raise FileNotFoundError(f"not found: {p}")
    kind = archive_kind(p)
    try:
        if kind == "zip":
            return _ZipTree(zipfile.ZipFile(p), str(p))
        if kind == "tar":
            return _TarTree(tarfile.open(p, mode="r:*"), str(p))
    except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError) as exc:
        raise ValueError(f"{p}: not a readable {kind} archive ({exc})") from exc
    raise ValueError(f"{p}: expected a directory, a .zip or a .tar(.gz) archive")


def _safe_target(dest: Path, name: str) -> Path | None:
    """Where member ``name`` goes under ``dest``, or None for metadata; raise if it escapes."""
    pure = PurePosixPath(name.replace("\\", "/"))
    if pure.is_absolute() or ".." in pure.parts or (pure.parts and ":" in pure.parts[0]):
        raise ValueError(f"unsafe path in archive: {name!r}")
    if not pure.parts or _is_metadata(pure.as_posix()):
        return None
    return dest.joinpath(*pure.parts)


def _iter_zip(zf: zipfile.ZipFile) -> Iterator[tuple[str, bool, zipfile.ZipInfo]]:
    for info in zf.infolist():
        mode = (info.external_attr >> 16) & 0o170000
        if mode == 0o120000:  # a symbolic link stored by Info-ZIP
            raise ValueError(f"link in archive: {info.filename!r}")
        yield info.filename, info.is_dir(), info


def extract_archive(archive: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """Unpack a ``.zip`` or ``.tar(.gz)`` archive into ``dest`` (created if needed).

    Only directories and regular files are written; macOS metadata is skipped. Absolute
    paths, ``..`` components, links and device files are refused before anything is written.

    Parameters
    ----------
    archive : str or os.PathLike
        The archive file.
    dest : str or os.PathLike
        The destination directory.

    Returns
    -------
    Path
        ``dest``.

    Raises
    ------
    ValueError
        If the archive is unreadable or holds an unsafe member.
    """
    src = Path(archive)
    out = Path(dest)
    kind = archive_kind(src)
    try:
        if kind == "zip":
            with zipfile.ZipFile(src) as zf:
                plan = [(_safe_target(out, n), d, info) for n, d, info in _iter_zip(zf)]
                for target, is_dir, info in plan:
                    if target is None:
                        continue
                    if is_dir:
                        target.mkdir(parents=True, exist_ok=True)
                        continue
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with zf.open(info) as fin, open(target, "wb") as fout:
                        shutil.copyfileobj(fin, fout)
            return out
        if kind == "tar":
            with tarfile.open(src, mode="r:*") as tf:
                members = tf.getmembers()
                for m in members:
                    if not (m.isfile() or m.isdir()):
                        raise ValueError(f"link or special file in archive: {m.name!r}")
                    _safe_target(out, m.name)
                for m in members:
                    target = _safe_target(out, m.name)
                    if target is None:
                        continue
                    if m.isdir():
                        target.mkdir(parents=True, exist_ok=True)
                        continue
                    target.parent.mkdir(parents=True, exist_ok=True)
                    fin = tf.extractfile(m)
                    assert fin is not None
                    with fin, open(target, "wb") as fout:
                        shutil.copyfileobj(fin, fout)
            return out
    except (zipfile.BadZipFile, tarfile.TarError, EOFError) as exc:
        raise ValueError(f"{src}: not a readable {kind} archive ({exc})") from exc
    raise ValueError(f"{src}: expected a .zip or .tar(.gz) archive")
