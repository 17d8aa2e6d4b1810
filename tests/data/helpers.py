"""Helpers shared by the data-layer tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

#: ``tests/../../shared/data``: the shared data files next to the checkout (never copied).
SHARED_DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data"

#: Type of the ``write_mat`` fixture.
MatWriter = Callable[..., Path]


def cell(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """A 1 x m object array, which ``scipy.io.savemat`` writes as a MATLAB cell array."""
    out = np.empty((1, len(arrays)), dtype=object)
    for i, a in enumerate(arrays):
        out[0, i] = a
    return out


def toy_tasks(
    sizes: Sequence[int] = (12, 9, 15), dim: int = 3, seed: int = 0
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Small random tasks with int16 column labels in {-1, +1} (both labels in each task)."""
    rng = np.random.default_rng(seed)
    Xs, ys = [], []
    for n in sizes:
        Xs.append(rng.standard_normal((n, dim)))
        ys.append(np.where(np.arange(n) % 3 == 0, 1, -1).astype(np.int16).reshape(-1, 1))
    return Xs, ys
