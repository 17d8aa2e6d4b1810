"""CFL's server numerics: cosine bi-partition, the split criterion, the recursion."""

from __future__ import annotations

import numpy as np
import pytest

from fmtl_flower.core.cfl import (
    EPS1,
    EPS2,
    bipartition,
    cosine_similarities,
    should_split,
    split_clusters,
    update_norms,
)


def opposite_groups(n_a: int = 7, n_b: int = 5, dim: int = 20, noise: float = 0.3,
                    seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Updates of two client groups pulling in opposite directions, rows shuffled."""
    rng = np.random.default_rng(seed)
    v = rng.normal(size=dim)
    v /= np.linalg.norm(v)
    rows = np.vstack([v + noise * rng.normal(size=(n_a, dim)) / np.sqrt(dim),
                      -v + noise * rng.normal(size=(n_b, dim)) / np.sqrt(dim)])
    group = np.r_[np.zeros(n_a, dtype=int), np.ones(n_b, dtype=int)]
    order = rng.permutation(n_a + n_b)
    return 2.0 * rows[order], group[order]


def test_cosine_similarities_are_cosines_and_zero_rows_are_zero():
    u = np.array([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0], [0.0, 0.0]])
    S = cosine_similarities(u)
    assert np.allclose(S[:3, :3], [[1, 0, -1], [0, 1, 0], [-1, 0, 1]])
    assert np.all(S[3] == 0) and np.all(S[:, 3] == 0)


def test_bipartition_separates_two_opposite_groups():
    updates, group = opposite_groups()
    first, second = bipartition(updates)
    assert 0 in first and len(first) + len(second) == len(group)
    assert set(group[first]) == {group[0]} and set(group[second]) == {1 - group[0]}


def test_criterion_splits_opposite_groups_not_a_homogeneous_one():
    updates, group = opposite_groups(n_a=6, n_b=6)
    mean_norm, max_norm = update_norms(updates)
    assert mean_norm < EPS1 < EPS2 < max_norm  # the federation is stationary, clients not
    assert should_split(updates)
    rng = np.random.default_rng(1)
    same = 2.0 + 0.1 * rng.normal(size=(12, 20))  # everyone pulls the same way
    assert update_norms(same)[0] > EPS1 and not should_split(same)
    tiny = 0.01 * rng.normal(size=(12, 20))  # everyone close to stationary
    assert update_norms(tiny)[1] < EPS2 and not should_split(tiny)
    assert not should_split(updates[:2])  # two clients are never split


def test_split_clusters_splits_only_the_mixed_cluster_and_keeps_silent_clients():
    updates, group = opposite_groups(n_a=6, n_b=6)
    rng = np.random.default_rng(2)
    ids_mixed = np.arange(12)
    ids_same = np.arange(12, 20)
    table = {int(t): updates[t] for t in ids_mixed}
    table.update({int(t): 2.0 + 0.1 * rng.normal(size=20) for t in ids_same})
    silent = 20  # in the mixed cluster but not heard from this round
    clusters = split_clusters([np.r_[ids_mixed, silent], ids_same], table)
    assert len(clusters) == 3
    a, b, same = (set(c.tolist()) for c in clusters)
    assert same == set(ids_same.tolist())
    assert silent in a and {group[t] for t in a - {silent}} == {group[0]}
    assert {group[t] for t in b} == {1 - group[0]} and len(a) + len(b) == 13


def test_bipartition_is_complete_linkage():
    hierarchy = pytest.importorskip("scipy.cluster.hierarchy")
    from scipy.spatial.distance import squareform

    rng = np.random.default_rng(3)
    for trial in range(20):
        updates = rng.normal(size=(int(rng.integers(3, 30)), 8))
        first, second = bipartition(updates)
        distance = np.clip(1.0 - cosine_similarities(updates), 0.0, None)
        np.fill_diagonal(distance, 0.0)
        labels = hierarchy.fcluster(hierarchy.linkage(squareform(distance, checks=False),
                                                      method="complete"), 2, "maxclust")
        expected = np.flatnonzero(labels == labels[0])
        assert np.array_equal(first, expected), trial
        assert np.array_equal(second, np.flatnonzero(labels != labels[0])), trial


def test_inputs_checked():
    with pytest.raises(ValueError, match="at least 2 rows"):
        bipartition(np.ones((1, 3)))
    with pytest.raises(ValueError, match="eps1 and eps2"):
        split_clusters([np.arange(3)], {}, eps1=-1.0)
