"""Fixtures for the data-layer tests."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import scipy.io

from fmtl_flower.data import clear_dataset_cache, download, paths

from .helpers import SHARED_DATA_DIR, MatWriter, cell


@pytest.fixture
def shared_data_dir() -> Path:
    """The directory with ``small.mat`` and ``EAT_VOC.mat``; skips the test if absent."""
    missing = [f for f in ("small.mat", "EAT_VOC.mat") if not (SHARED_DATA_DIR / f).is_file()]
    if missing:
        pytest.skip(f"shared data files {missing} not available in {SHARED_DATA_DIR}")
    return SHARED_DATA_DIR


@pytest.fixture
def write_mat(tmp_path: Path) -> MatWriter:
    """Write a .mat file into ``tmp_path`` and return its path.

    Call as ``write_mat("name.mat", X=[...], Y=[...], other=array)``: list values become
    1 x m cell arrays, other values are stored as they are.
    """

    def _write(filename: str, **variables: object) -> Path:
        path = tmp_path / filename
        contents = {k: cell(v) if isinstance(v, list) else v for k, v in variables.items()}
        scipy.io.savemat(path, contents)
        return path

    return _write


@pytest.fixture(autouse=True)
def _fresh_dataset_cache() -> Iterator[None]:
    """Isolate tests from each other's ``load_dataset_cached`` entries."""
    clear_dataset_cache()
    yield
    clear_dataset_cache()


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may reach the network: ``urllib.request.urlopen`` fails loudly."""

    def refuse(url: object, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted in a test: {url!r}")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)


@dataclass(frozen=True)
class DataEnv:
    """Isolated data and cache directories (``$FMTL_DATA_DIR``, ``$FMTL_CACHE_DIR``)."""

    data: Path
    cache: Path


@pytest.fixture
def data_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DataEnv:
    """Point ``FMTL_DATA_DIR`` / ``FMTL_CACHE_DIR`` into ``tmp_path`` and ignore other dirs.

    The data directories are still computed by the real ``default_data_dirs`` (so the
    environment variable is what is tested), but those outside ``tmp_path`` (the shared data
    next to the checkout) are dropped, so that a real copy there cannot change the outcome.
    """
    env = DataEnv(data=tmp_path / "data", cache=tmp_path / "cache")
    env.data.mkdir()
    monkeypatch.setenv("FMTL_DATA_DIR", str(env.data))
    monkeypatch.setenv("FMTL_CACHE_DIR", str(env.cache))
    monkeypatch.chdir(tmp_path)
    root = tmp_path.resolve()
    monkeypatch.setattr(
        download,
        "default_data_dirs",
        lambda: tuple(d for d in paths.default_data_dirs() if root in d.parents),
    )
    return env
