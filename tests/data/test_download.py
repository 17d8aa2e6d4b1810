"""Tests for fmtl_flower.data.download / archive: local copies, explicit fake downloads.

No test touches the network: ``urllib.request.urlopen`` is replaced (conftest) by a function
that fails, and the download tests serve archives they build themselves.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import tarfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fmtl_flower.data import (
    SOURCES,
    Mirror,
    default_cache_dir,
    download_dataset,
    load_dataset,
    load_har_tasks,
    locate_dataset,
    resolve_data_file,
)
from fmtl_flower.data.archive import extract_archive, open_tree
from fmtl_flower.data.download import candidate_paths

from .conftest import DataEnv
from .paper_layouts import outer_har_zip, tar_gz_tree, write_gleam, write_har, zip_tree


class FakeOpener:
    """Serves ``payloads[url]`` (bytes) or raises it (an exception); records the calls."""

    def __init__(self, payloads: dict[str, bytes | Exception]) -> None:
        self.payloads = payloads
        self.calls: list[tuple[str, float]] = []

    def __call__(self, url: str, timeout: float = 0.0) -> io.BytesIO:
        self.calls.append((url, timeout))
        payload = self.payloads[url]
        if isinstance(payload, Exception):
            raise payload
        return io.BytesIO(payload)


@pytest.fixture
def har_archive(tmp_path: Path) -> bytes:
    """UCI's published archive (outer zip holding ``UCI HAR Dataset.zip``), tiny."""
    root, _ = write_har(tmp_path / "build", train_subjects=(1, 2), test_subjects=(3,), rows=6)
    return outer_har_zip(zip_tree(root))


def _pin(monkeypatch: pytest.MonkeyPatch, name: str, data: bytes, **changes: object) -> None:
    """Make ``SOURCES[name]`` expect ``data`` (its SHA-256) at a fake URL."""
    src = SOURCES[name]
    mirror = Mirror(f"https://example.invalid/{src.archive}", hashlib.sha256(data).hexdigest())
    pinned = dataclasses.replace(src, mirrors=(mirror,), **changes)
    monkeypatch.setitem(SOURCES, name, pinned)


def test_cache_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FMTL_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == (tmp_path / "c").resolve()
    monkeypatch.delenv("FMTL_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == (tmp_path / "home" / ".cache" / "fmtl-flower").resolve()


def test_candidates_order(data_env: DataEnv) -> None:
    cands = candidate_paths("har")
    assert cands[0] == data_env.data.resolve() / "UCI HAR Dataset"
    assert cands[1] == data_env.data.resolve() / "UCI HAR Dataset.zip"
    assert (
        cands[-1] == data_env.cache.resolve() / "human+activity+recognition+using+smartphones.zip"
    )
    assert (
        candidate_paths("gleam", data_env.cache / "x")[-1].parent
        == (data_env.cache / "x").resolve()
    )


def test_data_dir_wins_over_cache(data_env: DataEnv) -> None:
    write_har(data_env.data)
    (data_env.cache / "UCI HAR Dataset").mkdir(parents=True)
    assert locate_dataset("har") == data_env.data.resolve() / "UCI HAR Dataset"
    assert resolve_data_file("har") == data_env.data.resolve() / "UCI HAR Dataset"


def test_no_implicit_download(data_env: DataEnv) -> None:
    # urlopen fails loudly (conftest): loading must raise FileNotFoundError, not touch it
    for name in ("har", "gleam", "vehicle"):
        with pytest.raises(FileNotFoundError, match="no local copy"):
            load_dataset(name)
        with pytest.raises(FileNotFoundError):
            resolve_data_file(name)


def test_fake_download_then_load(
    data_env: DataEnv, har_archive: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    _pin(monkeypatch, "har", har_archive)
    url = SOURCES["har"].mirrors[0].url
    opener = FakeOpener({url: har_archive})
    got = download_dataset("har", cache_dir=data_env.cache, opener=opener, timeout=5.0)
    assert got == data_env.cache.resolve() / "UCI HAR Dataset"
    assert opener.calls == [(url, 5.0)]
    assert sorted(p.name for p in data_env.cache.iterdir()) == ["UCI HAR Dataset"]  # no leftovers
    assert (got / "train" / "X_train.txt").is_file() and not list(got.rglob("._*"))
    # found in the cache by the loader, without downloading again
    ds = load_dataset("har", test_frac=0.0)
    assert ds.num_tasks == 3
    again = download_dataset("har", cache_dir=data_env.cache, opener=opener)
    assert again == got and len(opener.calls) == 1
    download_dataset("har", cache_dir=data_env.cache, opener=opener, force=True)
    assert len(opener.calls) == 2


def test_load_dataset_download_true_uses_urlopen(
    data_env: DataEnv, har_archive: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    _pin(monkeypatch, "har", har_archive)
    calls = []

    def fake_urlopen(url: str, timeout: float = 0.0) -> io.BytesIO:
        calls.append(url)
        return io.BytesIO(har_archive)

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    ds = load_dataset("har", download=True, seed=2)
    assert calls == [SOURCES["har"].mirrors[0].url]
    assert ds.num_tasks == 3 and (data_env.cache / "UCI HAR Dataset").is_dir()
    direct = load_har_tasks(data_env.cache / "UCI HAR Dataset")
    task = ds.task(0)  # the split keeps every row of subject 1, train or test
    pooled = np.vstack([task.X_train, task.X_test])
    np.testing.assert_array_equal(np.sort(pooled, axis=0), np.sort(direct.Xs[0], axis=0))


def test_published_sources() -> None:
    har, gleam, vehicle = SOURCES["har"], SOURCES["gleam"], SOURCES["vehicle"]
    assert har.mirrors[0].url.startswith("https://archive.ics.uci.edu/static/public/240/")
    assert all(len(m.sha256 or "") == 64 for m in har.mirrors)
    assert har.nested == "UCI HAR Dataset.zip" and har.target == "UCI HAR Dataset"
    assert gleam.mirrors[0].url == "http://www.skleinberg.org/data/GLEAM.tar.gz"
    assert gleam.mirrors[0].md5 == "10ad34716546e44c5078d392f25031e1"
    assert vehicle.mirrors == () and vehicle.target == "vehicle"


def test_checksum_mismatch(
    data_env: DataEnv, har_archive: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    _pin(monkeypatch, "har", har_archive)
    url = SOURCES["har"].mirrors[0].url
    with pytest.raises(ValueError, match="checksum mismatch"):
        download_dataset(
            "har", cache_dir=data_env.cache, opener=FakeOpener({url: har_archive + b"x"})
        )
    assert list(data_env.cache.iterdir()) == []  # partial file removed
    # an explicit url is checked only against an explicit sha256
    other = "https://mirror.invalid/har.zip"
    with pytest.raises(ValueError, match="checksum mismatch"):
        download_dataset(
            "har",
            cache_dir=data_env.cache,
            url=other,
            sha256="0" * 64,
            opener=FakeOpener({other: har_archive}),
        )
    got = download_dataset(
        "har", cache_dir=data_env.cache, url=other, opener=FakeOpener({other: har_archive})
    )
    assert (got / "test" / "y_test.txt").is_file()


def test_offline_tries_every_url(
    data_env: DataEnv, har_archive: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    _pin(monkeypatch, "har", har_archive)
    first = SOURCES["har"].mirrors[0]
    second = dataclasses.replace(first, url="https://mirror.invalid/UCI%20HAR%20Dataset.zip")
    monkeypatch.setitem(
        SOURCES, "har", dataclasses.replace(SOURCES["har"], mirrors=(first, second))
    )
    first, second = first.url, second.url
    down = FakeOpener({first: urllib.error.URLError("no route"), second: OSError("timed out")})
    with pytest.raises(OSError, match="download failed") as info:
        download_dataset("har", cache_dir=data_env.cache, opener=down)
    assert first in str(info.value) and second in str(info.value)
    fallback = FakeOpener({first: urllib.error.URLError("no route"), second: har_archive})
    assert download_dataset("har", cache_dir=data_env.cache, opener=fallback).is_dir()
    assert [u for u, _ in fallback.calls] == [first, second]


def test_archive_without_expected_content(
    data_env: DataEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("something/else.txt", "hello")
    data = buf.getvalue()
    _pin(monkeypatch, "har", data)
    with pytest.raises(ValueError, match="holds no 'train/X_train.txt'"):
        download_dataset(
            "har",
            cache_dir=data_env.cache,
            opener=FakeOpener({SOURCES["har"].mirrors[0].url: data}),
        )
    assert not (data_env.cache / "UCI HAR Dataset").exists()
    assert [p.name for p in data_env.cache.iterdir()] == []


def test_fake_gleam_tar_download(
    data_env: DataEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = write_gleam(tmp_path / "build", participants=("1", "2"), seconds=30.0)
    data = tar_gz_tree(root)
    mirror = Mirror("http://example.invalid/GLEAM.tar.gz", md5=hashlib.md5(data).hexdigest())
    monkeypatch.setitem(SOURCES, "gleam", dataclasses.replace(SOURCES["gleam"], mirrors=(mirror,)))
    got = download_dataset(
        "gleam",
        cache_dir=data_env.cache,
        opener=FakeOpener({SOURCES["gleam"].mirrors[0].url: data}),
    )
    assert got == data_env.cache.resolve() / "GLEAM"
    assert (got / "Demographics_Glass_data.csv").is_file()
    assert load_dataset("gleam", test_frac=0.0).num_tasks == 2


def test_vehicle_download_with_explicit_url(data_env: DataEnv, tmp_path: Path) -> None:
    from .paper_layouts import write_vehicle

    root = write_vehicle(tmp_path / "build", runs=("AAV3", "DW1"), nodes=(1, 2), rows=3)
    data = zip_tree(root, with_macosx=False)  # top folder "vehicle/"
    url = "https://example.invalid/sensit/vehicle.zip?download=1"
    with pytest.raises(ValueError, match="no direct download is known"):
        download_dataset("vehicle", cache_dir=data_env.cache)
    got = download_dataset(
        "vehicle", cache_dir=data_env.cache, url=url, opener=FakeOpener({url: data})
    )
    assert got == data_env.cache.resolve() / "vehicle" and (got / "AAV3" / "n1").is_dir()
    assert load_dataset("vehicle", test_frac=0.0).num_tasks == 2


def test_unknown_source() -> None:
    with pytest.raises(ValueError, match="no download source"):
        download_dataset("small")


def _zip_with(name: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(name, "x")
    return buf.getvalue()


@pytest.mark.parametrize("member", ["../evil.txt", "/abs/evil.txt", "a/../../evil.txt"])
def test_extract_refuses_unsafe_zip(tmp_path: Path, member: str) -> None:
    archive = tmp_path / "bad.zip"
    archive.write_bytes(_zip_with(member))
    with pytest.raises(ValueError, match="unsafe path"):
        extract_archive(archive, tmp_path / "out")
    assert not (tmp_path / "evil.txt").exists()


def test_extract_refuses_tar_links(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        info = tarfile.TarInfo("link")
        info.type = tarfile.SYMTYPE
        info.linkname = "/etc/passwd"
        tf.addfile(info)
    archive = tmp_path / "bad.tar.gz"
    archive.write_bytes(buf.getvalue())
    with pytest.raises(ValueError, match="link or special file"):
        extract_archive(archive, tmp_path / "out")


def test_open_tree_skips_macos_metadata(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("d/a.txt", "a")
        zf.writestr("__MACOSX/d/._a.txt", "junk")
        zf.writestr("d/.DS_Store", "junk")
    archive = tmp_path / "t.zip"
    archive.write_bytes(buf.getvalue())
    with open_tree(archive) as tree:
        assert tree.files == ["d/a.txt"] and tree.read_text("d/a.txt") == "a"
    plain = tmp_path / "t.txt"
    plain.write_text("x")
    with pytest.raises(ValueError, match="expected a directory"):
        open_tree(plain)
    with pytest.raises(FileNotFoundError):
        open_tree(tmp_path / "missing.zip")
