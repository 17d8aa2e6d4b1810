"""Clustered Federated Learning (Sattler, Müller and Samek 2020): the server's numerics.

CFL starts with one cluster holding every client and trains it as FedAvg does. After each
round it looks, in every cluster c, at the clients' updates dW_k = theta_k - theta_c (the
locally trained model minus the cluster model sent). When the cluster's federation has
reached a stationary point of the *joint* objective while single clients are still far from
theirs,

    || mean_k dW_k ||  <  eps1      and      max_k || dW_k ||  >  eps2,

and the cluster has more than two clients, it is split in two by the cosine similarities of
the updates (clients whose data come from different distributions pull in different
directions): complete-linkage agglomerative clustering of the pairwise cosine distances
1 - cos(dW_i, dW_j) into two groups. Each new cluster then averages its own clients' models,
and the recursion continues round after round inside each cluster.

Thresholds: the FedEM authors' implementation of this baseline (the paper's "clustered FL"
column) uses eps1 = 0.4 and eps2 = 1.6 (``tol_1``, ``tol_2``), no warm-up rounds, the plain
mean of the updates (not weighted by n_k) in the first test and clusters of more than two
clients; these are the defaults here (:data:`EPS1`, :data:`EPS2`).

Nothing here imports flwr; the strategy (:mod:`fmtl_flower.strategies.fedem`, method
``"cfl"``) keeps the clusters and calls :func:`split_clusters` after each round.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["EPS1", "EPS2", "bipartition", "cosine_similarities", "should_split",
           "split_clusters", "update_norms"]

#: The FedEM authors' thresholds for CFL (mean update norm below, max update norm above).
EPS1 = 0.4
EPS2 = 1.6


def cosine_similarities(updates: np.ndarray) -> np.ndarray:
    """Pairwise cosine similarities (n, n) of the rows of ``updates`` (a zero row: 0)."""
    updates = np.asarray(updates, dtype=np.float64)
    if updates.ndim != 2:
        raise ValueError(f"updates must be (n, P), got shape {updates.shape}")
    norms = np.linalg.norm(updates, axis=1)
    unit = np.divide(updates, norms[:, None], out=np.zeros_like(updates),
                     where=norms[:, None] > 0)
    return np.clip(unit @ unit.T, -1.0, 1.0)


def bipartition(updates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split the rows of ``updates`` in two by complete-linkage clustering of their cosine
    distances (Sattler et al.'s rule).

    Agglomerative: start from singletons and merge, repeatedly, the two groups whose largest
    pairwise distance 1 - cos is the smallest, until two groups remain (ties: the lowest
    indices first, so the result is deterministic).

    Returns
    -------
    first, second : ndarray of int
        Sorted row indices of the two groups; ``first`` holds row 0.
    """
    distance = 1.0 - cosine_similarities(updates)
    n = distance.shape[0]
    if n < 2:
        raise ValueError(f"bipartition needs at least 2 rows, got {n}")
    d = distance.copy()
    np.fill_diagonal(d, np.inf)
    alive = np.ones(n, dtype=bool)
    label = np.arange(n)
    for _ in range(n - 2):
        flat = int(np.argmin(d))
        i, j = divmod(flat, n)
        i, j = min(i, j), max(i, j)
        merged = np.maximum(d[i], d[j])  # complete linkage: the farthest pair
        d[i], d[:, i] = merged, merged
        d[i, i] = np.inf
        d[j], d[:, j] = np.inf, np.inf
        alive[j] = False
        label[label == j] = i
    roots = np.flatnonzero(alive)
    first = np.flatnonzero(label == label[0])
    second = np.flatnonzero(label == (roots[1] if roots[0] == label[0] else roots[0]))
    return first, second


#: How a cluster's updates (n, P) are averaged in the split test.
MeanUpdate = Callable[[np.ndarray], np.ndarray]


def _plain_mean(updates: np.ndarray) -> np.ndarray:
    return updates.mean(axis=0)


def update_norms(updates: np.ndarray, mean: MeanUpdate = _plain_mean) -> tuple[float, float]:
    """(|| mean_k dW_k ||, max_k || dW_k ||) of a cluster's updates (rows); ``mean`` the
    average taken (the plain mean, or a robust one)."""
    updates = np.asarray(updates, dtype=np.float64)
    if updates.ndim != 2 or updates.shape[0] < 1:
        raise ValueError(f"updates must be (n >= 1, P), got shape {updates.shape}")
    return (float(np.linalg.norm(mean(updates))),
            float(np.linalg.norm(updates, axis=1).max()))


def should_split(updates: np.ndarray, eps1: float = EPS1, eps2: float = EPS2,
                 mean: MeanUpdate = _plain_mean) -> bool:
    """Sattler et al.'s criterion: mean update norm < eps1, max update norm > eps2, and more
    than two clients in the cluster."""
    updates = np.asarray(updates, dtype=np.float64)
    if updates.ndim != 2 or updates.shape[0] <= 2:
        return False
    mean_norm, max_norm = update_norms(updates, mean)
    return mean_norm < eps1 and max_norm > eps2


def split_clusters(clusters: list[np.ndarray], updates: dict[int, np.ndarray],
                   eps1: float = EPS1, eps2: float = EPS2,
                   mean: MeanUpdate = _plain_mean) -> list[np.ndarray]:
    """One round of CFL's recursion: every cluster whose updates meet :func:`should_split`
    is replaced by its two halves (:func:`bipartition`); the others are kept.

    Parameters
    ----------
    clusters : list of int arrays
        The clients (task ids) of each cluster.
    updates : dict task id -> (P,) update
        The round's updates dW_k of the clients heard from; a cluster is judged on the
        updates of its clients present here (a client not heard from this round stays in
        the first half of a split).
    eps1, eps2 : float
        The thresholds of :func:`should_split`.
    mean : callable, optional
        The average of a cluster's updates in the split test (default the plain mean;
        robust mode passes a trimmed mean, so one device cannot hold back or force a split).

    Returns
    -------
    list of int arrays
        The new clusters, in order (a split cluster's halves replace it in place).
    """
    if not eps1 >= 0 or not eps2 >= 0:
        raise ValueError(f"eps1 and eps2 must be >= 0, got {eps1}, {eps2}")
    out: list[np.ndarray] = []
    for members in clusters:
        heard = [int(t) for t in members if int(t) in updates]
        if len(heard) <= 2:
            out.append(np.asarray(members, dtype=int))
            continue
        block = np.stack([updates[t] for t in heard])
        if not should_split(block, eps1, eps2, mean):
            out.append(np.asarray(members, dtype=int))
            continue
        first, second = bipartition(block)
        second_ids = {heard[i] for i in second}
        out.append(np.array([int(t) for t in members if int(t) not in second_ids], dtype=int))
        out.append(np.array(sorted(second_ids), dtype=int))
    return out
