"""Fixtures for the data-layer tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import scipy.io

from fmtl_flower.data import clear_dataset_cache

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
