"""The FSVRG-style sparse federated generator, its containers and its registry entry."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.linear_model import LogisticRegression

from fmtl_flower.core.fsvrg import combine_feature_counts, node_feature_counts
from fmtl_flower.data import (
    SPARSE_FEDERATED,
    SparseFederatedDataset,
    SparseTaskData,
    available_datasets,
    constant_error,
    linear_model_error,
    load_dataset,
    load_dataset_cached,
    majority_vote_error,
    make_sparse_federated,
    make_sparse_task,
)


def same_task(a: SparseTaskData, b: SparseTaskData) -> bool:
    return all(
        x.shape == z.shape and ((x != z).nnz == 0 if sp.issparse(x) else np.array_equal(x, z))
        for x, z in zip(a.arrays(), b.arrays(), strict=True)
    )


def row_keys(X: sp.csr_matrix, y: np.ndarray) -> list[tuple]:
    return sorted((tuple(X.indices[X.indptr[i]:X.indptr[i + 1]]), y[i])
                  for i in range(X.shape[0]))


@pytest.fixture(scope="module")
def fed() -> SparseFederatedDataset:
    return make_sparse_federated(200, dim=20_000, seed=0)


def test_structure(fed: SparseFederatedDataset) -> None:
    assert fed.num_tasks == 200 and fed.dim == 20_000 and not fed.iid
    for t in fed.tasks:
        for X, y in ((t.X_train, t.y_train), (t.X_test, t.y_test)):
            assert isinstance(X, sp.csr_matrix) and X.dtype == np.float64
            assert X.has_canonical_format
            assert np.all(X.data == 1.0)  # binary bag of words
            assert set(np.unique(y)) <= {-1.0, 1.0}
            assert X.shape[0] == 0 or np.all(X[:, 0].toarray() == 1.0)  # bias in every row
        assert t.n_train >= 1
        assert abs(t.n_test - 0.25 * (t.n_train + t.n_test)) <= 1
    # heavy-tailed sizes: tens to thousands
    n = fed.n_train
    assert n.min() >= 29 and n.max() >= 1000 and np.median(n) < 100
    assert np.mean(n) > 1.5 * np.median(n)


def test_feature_presence_is_skewed(fed: SparseFederatedDataset) -> None:
    stats = combine_feature_counts(node_feature_counts(t.X_train) for t in fed.tasks)
    K = fed.num_tasks
    present = stats.omega > 0
    assert stats.omega[0] == K  # the bias: on every node
    assert 1 <= np.sum(stats.omega == K) <= 20  # a few features present everywhere
    # most features are on few nodes (paper: 88 % on < 10 % of the nodes)
    assert np.mean(stats.omega[present] < K / 10) > 0.85
    # rows are short: ~ 1 + 1 + 10 words
    nnz = sum(t.X_train.nnz for t in fed.tasks) / fed.n_train.sum()
    assert 8 < nnz < 16


def test_deterministic_and_nodes_independent_of_K() -> None:
    a = make_sparse_federated(12, dim=3000, seed=4)
    b = make_sparse_federated(30, dim=3000, seed=4)
    assert all(same_task(x, y) for x, y in zip(a.tasks, b.tasks[:12], strict=False))
    assert same_task(a.task(7), make_sparse_task(7, dim=3000, seed=4))
    c = make_sparse_federated(12, dim=3000, seed=5)
    assert not same_task(a.task(0), c.task(0))


def test_iid_reshuffle_keeps_rows_and_sizes() -> None:
    non = make_sparse_federated(60, dim=3000, seed=1)
    iid = make_sparse_federated(60, dim=3000, seed=1, iid=True)
    assert iid.iid
    np.testing.assert_array_equal(non.n_train, iid.n_train)
    np.testing.assert_array_equal(non.n_test, iid.n_test)
    for part in ("pooled_train", "pooled_test"):
        assert row_keys(*getattr(non, part)()) == row_keys(*getattr(iid, part)())
    # per-node label rates: spread out (node bias) vs homogeneous after the reshuffle
    big = non.n_train >= 100

    def rate_std(ds):
        return np.std([np.mean(t.y_train > 0) for t, b in zip(ds.tasks, big, strict=True) if b])

    assert rate_std(non) > 0.25 and rate_std(iid) < 0.1
    # a per-node majority vote says nothing on IID nodes
    assert majority_vote_error(iid) > constant_error(iid) - 0.02
    assert majority_vote_error(non) < constant_error(non) - 0.1


def test_naive_predictors_rank_as_in_the_paper() -> None:
    # paper (section 4.1): all -1 33.16 %, global optimum 26.27 %, per-author majority 17.14 %
    ds = make_sparse_federated(300, dim=5000, seed=0)
    X, y = ds.pooled_train()
    n = X.shape[0]
    lam = 1.0 / n  # the paper's lambda
    clf = LogisticRegression(fit_intercept=False, C=1.0 / (lam * n), tol=1e-6, max_iter=5000)
    w = clf.fit(X, y).coef_.ravel()
    all_neg, glob, major = constant_error(ds), linear_model_error(ds, w), majority_vote_error(ds)
    # measured: 0.423, 0.293, 0.222 (at K = 1000, d = 20000: 0.330, 0.264, 0.178)
    assert major < glob - 0.03
    assert glob < all_neg - 0.05
    assert all_neg < 0.5


def test_containers_validate() -> None:
    X = sp.csr_matrix(np.ones((2, 3)))
    y = np.array([1.0, -1.0])
    empty = sp.csr_matrix((0, 3))
    t = SparseTaskData(X, y, empty, np.zeros(0))
    assert (t.n_train, t.n_test, t.dim) == (2, 0, 3)
    assert t.nbytes > 0
    with pytest.raises(TypeError, match="CSR"):
        SparseTaskData(X.toarray(), y, empty, np.zeros(0))
    with pytest.raises(ValueError, match="-1, \\+1"):
        SparseTaskData(X, np.array([1.0, 0.0]), empty, np.zeros(0))
    with pytest.raises(ValueError, match="features"):
        SparseTaskData(X, y, sp.csr_matrix((0, 4)), np.zeros(0))
    with pytest.raises(ValueError, match="rows"):
        SparseTaskData(X, y[:1], empty, np.zeros(0))
    ds = SparseFederatedDataset("x", [t, t])
    assert ds.num_tasks == 2 and list(ds.n_train) == [2, 2]
    Xp, yp = ds.pooled_train()
    assert Xp.shape == (4, 3) and yp.shape == (4,)
    with pytest.raises(IndexError):
        ds.task(2)
    with pytest.raises(TypeError):
        SparseFederatedDataset("x", [object()])
    with pytest.raises(ValueError, match="no tasks"):
        SparseFederatedDataset("x", [])


def test_generator_validates_arguments() -> None:
    with pytest.raises(ValueError, match="num_tasks"):
        make_sparse_federated(0)
    with pytest.raises(ValueError, match="unknown generator"):
        make_sparse_federated(2, dim=1000, nonsense=1)
    with pytest.raises(ValueError, match="too small"):
        make_sparse_federated(2, dim=50)
    with pytest.raises(ValueError, match="test_frac"):
        make_sparse_task(0, dim=1000, test_frac=1.0)
    with pytest.raises(ValueError, match="iid"):
        make_sparse_federated(2, dim=1000, iid="yes")


def test_registry_entry() -> None:
    assert SPARSE_FEDERATED == "sparse-federated"
    assert "sparse-federated" in available_datasets()
    ds = load_dataset("sparse-federated", num_tasks=15, dim=2000, seed=3, test_frac=0.3)
    assert isinstance(ds, SparseFederatedDataset) and ds.num_tasks == 15
    assert same_task(ds.task(4), make_sparse_task(4, dim=2000, seed=3, test_frac=0.3))
    iid = load_dataset("sparse-federated", num_tasks=15, dim=2000, seed=3, iid=True)
    assert iid.iid
    with pytest.raises(ValueError, match="iid only applies"):
        load_dataset("synthetic", iid=True)
    with pytest.raises(ValueError, match="skew"):
        load_dataset("sparse-federated", num_tasks=3, dim=2000, skew=10)
    with pytest.raises(ValueError, match="samples_per_task must be an int >= 2"):
        load_dataset("sparse-federated", num_tasks=3, dim=2000, samples_per_task=1)
    with pytest.raises(ValueError, match="only apply to 'fedem-synthetic'"):
        load_dataset("sparse-federated", num_tasks=3, dim=2000, n_test=10)


def test_registry_cache_normalises_and_freezes() -> None:
    a = load_dataset_cached("sparse-federated", num_tasks=10, dim=2000)
    b = load_dataset_cached("sparse-federated", num_tasks=10, dim=2000, iid=False)
    assert a is b
    c = load_dataset_cached("sparse-federated", num_tasks=10, dim=2000, iid=True)
    assert c is not a and c.iid
    X = a.task(0).X_train
    assert not X.data.flags.writeable and not X.indices.flags.writeable
    assert not a.task(0).y_train.flags.writeable


@pytest.mark.parametrize("samples", [20, 400])
def test_samples_per_task_sets_the_median_node_size(samples) -> None:
    """samples_per_task is the median rows per node (before the split), eager and lazy alike."""
    from fmtl_flower.data.sparse_federated import size_params

    ds = load_dataset("sparse-federated", num_tasks=400, dim=2000, seed=1,
                      samples_per_task=samples, test_frac=0.0)
    rows = np.array([ds.task(t).X_train.shape[0] for t in range(ds.num_tasks)])
    assert 0.8 * samples <= np.median(rows) <= 1.2 * samples
    assert rows.min() >= size_params(samples)["size_min"]
    assert ds.params["size_min"] == size_params(samples)["size_min"]
    lazy = load_dataset("sparse-federated", num_tasks=400, dim=2000, seed=1,
                        samples_per_task=samples, test_frac=0.0, lazy=True)
    assert same_task(lazy.task(7), ds.task(7))
    default = load_dataset("sparse-federated", num_tasks=400, dim=2000, seed=1, test_frac=0.0)
    assert not same_task(default.task(7), ds.task(7))
