"""The sparsity statistics of section 3.6.1 (n_k^j, phi, omega, a, s_k), federated: counts on
the nodes, combined on the server (see :mod:`fmtl_flower.core.fsvrg`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .logistic import (
    _as_csr,
)


def node_feature_counts(X: Any) -> tuple[int, np.ndarray]:
    """Node-side: ``(n_k, counts_k)`` with ``counts_k[j] = n_k^j``, rows with ``x_ij != 0``.

    Explicit zeros are not counted; duplicate entries of a row count once (as their sum, if
    nonzero). This and nothing else is sent for the statistics.

    Returns
    -------
    n_k : int
    counts_k : ndarray (d,), int64
    """
    X = _as_csr(X)
    if not X.has_canonical_format:
        X = X.copy()
        X.sum_duplicates()
    nonzero = X.data != 0.0
    counts = np.bincount(X.indices[nonzero], minlength=X.shape[1]).astype(np.int64)
    return int(X.shape[0]), counts


def aggregation_weights(omega: Any, num_nodes: int) -> np.ndarray:
    """``a^j = K / omega^j``, and ``1`` where ``omega^j = 0`` (the diagonal of ``A``)."""
    om = np.asarray(omega, dtype=np.float64).reshape(-1)
    a = np.ones_like(om)
    present = om > 0
    a[present] = float(num_nodes) / om[present]
    return a


def node_scaling(phi: Any, n_k: int, counts_k: Any) -> np.ndarray:
    """``s_k^j = phi^j / phi_k^j = phi^j n_k / n_k^j``, and ``1`` where ``n_k^j = 0``.

    Node-side (from the broadcast ``phi`` and the node's own counts) or server-side.
    """
    ph = np.asarray(phi, dtype=np.float64).reshape(-1)
    c = np.asarray(counts_k).reshape(-1)
    if c.shape != ph.shape:
        raise ValueError(f"counts_k has length {c.shape[0]} but phi has {ph.shape[0]}")
    if np.any(c < 0) or np.any(c > n_k):
        raise ValueError(f"counts_k must be in [0, n_k = {n_k}]")
    s = np.ones_like(ph)
    present = c > 0
    s[present] = ph[present] * float(n_k) / c[present].astype(np.float64)
    return s


@dataclass(frozen=True, eq=False)
class FeatureStats:
    """The server's combination of the nodes' counts (section 3.6.1).

    Attributes
    ----------
    num_nodes : int
        ``K``, the number of nodes that reported.
    n : int
        ``sum_k n_k``.
    n_j : ndarray (d,), int64
        ``n^j``, rows (over all nodes) with feature ``j`` nonzero.
    omega : ndarray (d,), int64
        ``omega^j``, nodes with ``n_k^j > 0``.
    """

    num_nodes: int
    n: int
    n_j: np.ndarray
    omega: np.ndarray

    @property
    def dim(self) -> int:
        """``d``."""
        return int(self.n_j.shape[0])

    @property
    def phi(self) -> np.ndarray:
        """``phi^j = n^j / n`` (float64, ``(d,)``); broadcast it to the nodes for ``s_k``."""
        return self.n_j.astype(np.float64) / float(self.n)

    @property
    def a(self) -> np.ndarray:
        """``a^j = K / omega^j`` (``1`` where ``omega^j = 0``): the diagonal of ``A``."""
        return aggregation_weights(self.omega, self.num_nodes)

    def node_scaling(self, n_k: int, counts_k: Any) -> np.ndarray:
        """``s_k`` of a node from its counts (:func:`node_scaling` with this ``phi``)."""
        return node_scaling(self.phi, n_k, counts_k)


class FeatureCountAccumulator:
    """Server-side, streaming: add each node's ``(n_k, counts_k)``, then :meth:`result`.

    Holds ``O(d)`` numbers whatever ``K`` (so ``K = 10,000`` nodes need no ``K x d`` table).
    """

    def __init__(self, dim: int) -> None:
        if int(dim) < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.dim = int(dim)
        self.num_nodes = 0
        self.n = 0
        self.n_j = np.zeros(self.dim, dtype=np.int64)
        self.omega = np.zeros(self.dim, dtype=np.int64)

    def add(self, n_k: int, counts_k: Any) -> None:
        """Add one node's counts (validated: shape ``(d,)``, integers in ``[0, n_k]``)."""
        n_k = int(n_k)
        if n_k < 0:
            raise ValueError(f"n_k must be >= 0, got {n_k}")
        c = np.asarray(counts_k).reshape(-1)
        if c.shape != (self.dim,):
            raise ValueError(f"counts_k must have shape ({self.dim},), got {c.shape}")
        if c.size and c.dtype.kind not in "iu":
            if not np.all(np.isfinite(c)) or not np.all(c == np.round(c)):
                raise ValueError("counts_k must be integers")
        c = c.astype(np.int64)
        if np.any(c < 0) or np.any(c > n_k):
            raise ValueError(f"counts_k must be in [0, n_k = {n_k}]")
        self.num_nodes += 1
        self.n += n_k
        self.n_j += c
        self.omega += c > 0

    def result(self) -> FeatureStats:
        """The :class:`FeatureStats` of the nodes added so far (``n > 0`` required)."""
        if self.n <= 0:
            raise ValueError("no data: the nodes added so far hold no rows")
        return FeatureStats(self.num_nodes, self.n, self.n_j.copy(), self.omega.copy())


def combine_feature_counts(node_counts: Iterable[tuple[int, Any]]) -> FeatureStats:
    """Server-side: :class:`FeatureStats` from an iterable of ``(n_k, counts_k)`` pairs."""
    acc: FeatureCountAccumulator | None = None
    for n_k, counts_k in node_counts:
        if acc is None:
            acc = FeatureCountAccumulator(np.asarray(counts_k).reshape(-1).shape[0])
        acc.add(n_k, counts_k)
    if acc is None:
        raise ValueError("no node counts given")
    return acc.result()
