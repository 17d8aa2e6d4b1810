"""The authors' image splits, the generated relabelled mixture, and the CIFAR-10 / EMNIST
loaders on small local copies in the published layouts (nothing is downloaded)."""

from __future__ import annotations

import gzip
import pickle

import numpy as np
import pytest

from fmtl_flower.data.fedem_images import (
    dirichlet_label_split,
    find_local_copy,
    load_cifar10,
    load_emnist,
    pachinko_split,
    relabelled_mixture,
)


def test_dirichlet_label_split_partitions_and_skews_labels():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 100)
    parts = dirichlet_label_split(labels, 20, 0.4, rng)
    joined = np.sort(np.concatenate(parts))
    np.testing.assert_array_equal(joined, np.arange(1000))
    # Dirichlet(0.4): a client's largest label holds far more than the 10 % of an iid split
    shares = [np.bincount(labels[p], minlength=10).max() / p.size for p in parts if p.size]
    assert np.median(shares) > 0.3
    iid = dirichlet_label_split(labels, 20, 1e4, np.random.default_rng(0))
    assert np.median([np.bincount(labels[p], minlength=10).max() / p.size for p in iid]) < 0.2
    grouped = dirichlet_label_split(labels, 5, 0.4, np.random.default_rng(1), num_clusters=2)
    np.testing.assert_array_equal(np.sort(np.concatenate(grouped)), np.arange(1000))
    with pytest.raises(ValueError, match="num_clusters"):
        dirichlet_label_split(labels, 5, 0.4, rng, num_clusters=11)


def test_pachinko_split_is_disjoint_sized_and_coarse_skewed():
    fine = np.repeat(np.arange(12), 50)
    coarse = fine // 3
    parts = pachinko_split(fine, coarse, 10, 0.2, 10.0, np.random.default_rng(0))
    assert [p.size for p in parts] == [60] * 10
    joined = np.concatenate(parts)
    assert np.unique(joined).size == joined.size
    shares = [np.bincount(coarse[p], minlength=4).max() / p.size for p in parts]
    assert np.median(shares) > 0.5  # alpha = 0.2 over 4 coarse labels: concentrated
    with pytest.raises(ValueError, match="exceed"):
        pachinko_split(fine, coarse, 10, 0.2, 10.0, np.random.default_rng(0),
                       samples_per_client=61)


@pytest.mark.parametrize("split", ["dirichlet", "pachinko"])
def test_relabelled_mixture_relabels_the_same_images(split):
    tasks = relabelled_mixture(num_clients=8, samples=60, num_classes=6, size=8, split=split,
                               seed=3)
    assert tasks.num_tasks == 8 and tasks.pi.shape == (8, 3)
    np.testing.assert_allclose(tasks.pi.sum(axis=1), 1.0)
    for X, y, Xt, yt in zip(tasks.X, tasks.y, tasks.X_test, tasks.y_test, strict=True):
        assert X.dtype == np.float32 and X.shape[1:] == (1, 8, 8) and X.shape[0] >= 1
        assert Xt.shape[0] >= 1 and y.max() < 6 and yt.shape[0] == Xt.shape[0]
    again = relabelled_mixture(num_clients=8, samples=60, num_classes=6, size=8, split=split,
                               seed=3)
    np.testing.assert_array_equal(again.y[2], tasks.y[2])


def test_relabelled_mixture_labels_follow_the_components():
    """With one-hot mixture weights (mix_alpha tiny) each client is one permutation: the
    nearest prototype of an image and its label agree up to that client's permutation,
    and not all clients use the same one."""
    tasks = relabelled_mixture(num_clients=12, samples=80, num_classes=5, size=8, noise=0.1,
                               mix_alpha=1e-3, seed=0)
    from fmtl_flower.data.fedem_images import generated_images

    rng = np.random.default_rng([0, 4242])
    _, _, protos = generated_images(1, 5, rng, size=8, noise=0.1)
    mappings = set()
    for X, y in zip(tasks.X, tasks.y, strict=True):
        base = np.argmin(((X[:, 0, None] - protos[None]) ** 2).sum(axis=(2, 3)), axis=1)
        pairs = set(zip(base.tolist(), y.tolist(), strict=True))
        assert len(pairs) == len({b for b, _ in pairs})  # a function of the base class
        mappings.add(frozenset(pairs))
    assert len({tuple(sorted(m)) for m in mappings}) > 1


def test_cifar10_local_copy(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, size=(2, 3072), dtype=np.uint8),
                 b"labels": [1, 7]}
        with open(root / name, "wb") as f:
            pickle.dump(batch, f)
    X, y, Xt, yt = load_cifar10(tmp_path)
    assert X.shape == (10, 3, 32, 32) and Xt.shape == (2, 3, 32, 32)
    assert X.dtype == np.float32 and 0 <= X.min() and X.max() <= 1
    np.testing.assert_array_equal(y, [1, 7] * 5)


def _idx(path, array):
    header = bytes([0, 0, 8, array.ndim]) + b"".join(
        int(s).to_bytes(4, "big") for s in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_emnist_local_copy_is_read_upright(tmp_path):
    folder = tmp_path / "gzip"
    folder.mkdir()
    images = np.zeros((3, 28, 28), dtype=np.uint8)
    images[:, 0, 5] = 255  # published transposed: row 0, column 5 -> upright row 5, column 0
    for part in ("train", "test"):
        _idx(folder / f"emnist-digits-{part}-images-idx3-ubyte.gz", images)
        _idx(folder / f"emnist-digits-{part}-labels-idx1-ubyte.gz", np.array([3, 1, 4]))
    X, y, Xt, yt = load_emnist("digits", tmp_path)
    assert X.shape == (3, 1, 28, 28) and X[0, 0, 5, 0] == 1.0 and X[0, 0, 0, 5] == 0.0
    np.testing.assert_array_equal(yt, [3, 1, 4])


def test_missing_local_copy_names_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        load_cifar10(tmp_path)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        find_local_copy(["x"], tmp_path)
