"""Fixtures for the strategy tests: quiet Flower logging and compiled numba kernels."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest

from fmtl_flower.core.rng import coordinate_order
from fmtl_flower.core.sdca import sdca_local_update


@pytest.fixture(autouse=True, scope="module")
def quiet_flower() -> Iterator[None]:
    """Flower logs every round at INFO; keep WARNING and above (the rejection reasons).

    Module scope, so hypothesis tests do not see a function-scoped fixture.
    """
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)


@pytest.fixture(autouse=True, scope="session")
def compiled_kernels() -> None:
    """Compile (or load) the numba kernels once, so no ClientApp call pays for it.

    Matters for the late-reply tests, which time individual calls.
    """
    X = np.eye(3)
    sdca_local_update(X, np.ones(3), np.zeros(3), np.zeros(3), budget=3, m_tt=1.0,
                      sigma_prime=1.0, order=coordinate_order(0, 0, 1, 3))
