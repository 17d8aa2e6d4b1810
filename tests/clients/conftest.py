"""Fixtures for the client tests: quiet Flower logging, Message identity, compiled kernels."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest
from flwr.supercore.task_identity import TaskIdentity

from fmtl_flower.core.rng import coordinate_order
from fmtl_flower.core.sdca import sdca_local_update


@pytest.fixture(autouse=True, scope="module")
def quiet_flower() -> Iterator[None]:
    """Flower logs at INFO; keep WARNING and above."""
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    """``Message(...)`` needs a TaskIdentity (``InProcessGrid.__init__`` sets the same)."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


@pytest.fixture(autouse=True, scope="session")
def compiled_kernels() -> None:
    """Compile (or load) the numba kernels once, outside any timed call."""
    X = np.eye(3)
    sdca_local_update(X, np.ones(3), np.zeros(3), np.zeros(3), budget=3, m_tt=1.0,
                      sigma_prime=1.0, order=coordinate_order(0, 0, 1, 3))
