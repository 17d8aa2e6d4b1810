"""Image data for FedEM's image experiments: the authors' splits, generated images, and
local copies of CIFAR-10 / EMNIST in their published layouts.

Splits (Marfoq et al. 2021, Section 4 and their released ``generate_data`` scripts, written
here from the description):

* :func:`dirichlet_label_split` (CIFAR-10, EMNIST): the labels are grouped into clusters (one
  label per cluster by default), and each cluster's samples are divided among the clients in
  proportions drawn from a symmetric Dirichlet(alpha) (alpha = 0.4 in the paper);
* :func:`pachinko_split` (CIFAR-100, Pachinko allocation of Li & McCallum as used by Reddi et
  al.): every client draws a distribution over coarse labels from Dirichlet(alpha) and, per
  coarse label, one over its fine labels from Dirichlet(beta); its samples are drawn one by
  one, coarse then fine label, without replacement, exhausted labels being removed and the
  distributions renormalised.

Data that run offline:

* :func:`generated_images`: class-prototype images (smooth random patterns per class, plus
  pixel noise), float32 (n, 1, H, W);
* :func:`relabelled_mixture`: the FedEM setting on images. M components share the inputs and
  each relabels them with its own permutation of the classes; a client draws its mixture
  weights pi ~ Dirichlet(mix_alpha) and every sample its component z ~ pi, so the label of
  an image of base class c is sigma_z(c). One global model cannot fit the conflicting labels,
  a mixture of M models can.

Local copies (never downloaded): :func:`load_cifar10` reads ``cifar-10-batches-py/`` (the
python version: ``data_batch_1..5`` and ``test_batch``), :func:`load_emnist` the gzip IDX
files ``emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte.gz`` (in ``gzip/`` or
``emnist/gzip/``), looked for in the data directories and the cache
(:mod:`fmtl_flower.data.paths`).
"""

from __future__ import annotations

import gzip
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.rng import TAG_IMAGES
from .paths import default_cache_dir, default_data_dirs

__all__ = ["ImageTasks", "dirichlet_label_split", "find_local_copy", "generated_images",
           "load_cifar10", "load_emnist", "pachinko_split", "relabelled_mixture",
           "train_test_tasks"]


def dirichlet_label_split(labels: np.ndarray, num_clients: int, alpha: float,
                          rng: np.random.Generator, num_clusters: int = -1) -> list[np.ndarray]:
    """Indices of each client's samples: per label cluster, Dirichlet(alpha) proportions.

    Parameters
    ----------
    labels : ndarray (N,)
        Class of every sample (0..C-1).
    num_clients : int
    alpha : float
        Concentration of the symmetric Dirichlet (0.4 in the paper).
    rng : numpy Generator
    num_clusters : int
        Labels are shuffled and cut into this many groups of consecutive labels; -1: one
        group per label.

    Returns
    -------
    list of int64 arrays, one per client (possibly empty), together a partition of 0..N-1.
    """
    labels = np.asarray(labels)
    classes = int(labels.max()) + 1
    groups = classes if num_clusters == -1 else int(num_clusters)
    if not 1 <= groups <= classes or num_clients < 1 or not alpha > 0:
        raise ValueError(f"need 1 <= num_clusters <= {classes}, num_clients >= 1, alpha > 0")
    order = rng.permutation(classes)
    cluster_of = np.empty(classes, dtype=np.int64)
    for g, members in enumerate(np.array_split(order, groups)):
        cluster_of[members] = g
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for g in range(groups):
        members = rng.permutation(np.flatnonzero(cluster_of[labels] == g))
        counts = rng.multinomial(members.size, rng.dirichlet(np.full(num_clients, alpha)))
        for k, chunk in enumerate(np.split(members, np.cumsum(counts)[:-1])):
            parts[k].append(chunk)
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


def pachinko_split(fine: np.ndarray, coarse: np.ndarray, num_clients: int, alpha: float,
                   beta: float, rng: np.random.Generator,
                   samples_per_client: int | None = None) -> list[np.ndarray]:
    """Pachinko allocation: coarse label ~ Dirichlet(alpha), fine | coarse ~ Dirichlet(beta).

    Parameters
    ----------
    fine, coarse : ndarray (N,)
        Fine and coarse label of every sample (each fine label within one coarse label).
    num_clients : int
    alpha, beta : float
        Concentrations over coarse labels and over the fine labels of a coarse label.
    rng : numpy Generator
    samples_per_client : int, optional
        Default N // num_clients.

    Returns
    -------
    list of int64 arrays of sample indices, disjoint.
    """
    fine, coarse = np.asarray(fine), np.asarray(coarse)
    n_coarse = int(coarse.max()) + 1
    children = [np.unique(fine[coarse == c]) for c in range(n_coarse)]
    pools = {int(f): list(rng.permutation(np.flatnonzero(fine == f))) for f in np.unique(fine)}
    size = fine.size // num_clients if samples_per_client is None else int(samples_per_client)
    if size * num_clients > fine.size:
        raise ValueError(f"{num_clients} clients x {size} samples exceed the {fine.size} "
                         "samples")
    alive_fine = {int(f) for f in pools}
    out = []
    for _ in range(num_clients):
        p_coarse = rng.dirichlet(np.full(n_coarse, alpha))
        p_fine = [rng.dirichlet(np.full(ch.size, beta)) for ch in children]
        taken = []
        for _ in range(size):
            live_c = np.array([any(int(f) in alive_fine for f in children[c])
                               for c in range(n_coarse)])
            pc = p_coarse * live_c
            if pc.sum() <= 0:  # the client's coarse labels are exhausted: any live one
                pc = live_c.astype(float)
            c = int(rng.choice(n_coarse, p=pc / pc.sum()))
            live_f = np.array([int(f) in alive_fine for f in children[c]])
            pf = p_fine[c] * live_f
            if pf.sum() <= 0:
                pf = live_f.astype(float)
            f = int(children[c][rng.choice(children[c].size, p=pf / pf.sum())])
            taken.append(pools[f].pop())
            if not pools[f]:
                alive_fine.discard(f)
        out.append(np.sort(np.array(taken, dtype=np.int64)))
    return out


def generated_images(n: int, num_classes: int, rng: np.random.Generator, size: int = 12,
                     noise: float = 0.6, prototypes: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Images of ``num_classes`` classes: a smooth random prototype per class plus noise.

    Returns
    -------
    X : float32 (n, 1, size, size)
    y : int64 (n,), uniform over the classes
    prototypes : float32 (num_classes, size, size), unit-variance patterns (pass them back
        to draw more images of the same classes)
    """
    if prototypes is None:
        raw = rng.normal(size=(num_classes, size + 4, size + 4))
        kernel = np.ones(5) / 5.0  # box blur along both axes: smooth strokes, not pixel noise
        raw = np.apply_along_axis(lambda r: np.convolve(r, kernel, "valid"), 1, raw)
        raw = np.apply_along_axis(lambda r: np.convolve(r, kernel, "valid"), 2, raw)
        raw -= raw.mean(axis=(1, 2), keepdims=True)
        prototypes = (raw / raw.std(axis=(1, 2), keepdims=True)).astype(np.float32)
    y = rng.integers(0, num_classes, size=n)
    X = prototypes[y] + noise * rng.normal(size=(n, size, size))
    return X[:, None].astype(np.float32), y.astype(np.int64), prototypes


@dataclass(frozen=True)
class ImageTasks:
    """Per-client image data: X float32 (n_k, channels, H, W), y int64, plus the truth."""

    X: list[np.ndarray]
    y: list[np.ndarray]
    X_test: list[np.ndarray]
    y_test: list[np.ndarray]
    pi: np.ndarray  # (K, M) the clients' true mixture weights (empty for real data)
    num_classes: int

    @property
    def num_tasks(self) -> int:
        return len(self.X)


def train_test_tasks(X: np.ndarray, y: np.ndarray, parts: Sequence[np.ndarray],
                     test_frac: float, rng: np.random.Generator, num_classes: int,
                     pi: np.ndarray | None = None) -> ImageTasks:
    """Cut every client's samples into train / test (``test_frac`` of them, at least one
    training sample)."""
    Xs, ys, Xt, yt = [], [], [], []
    for idx in parts:
        idx = rng.permutation(idx)
        cut = min(idx.size - 1, int(round(test_frac * idx.size)))
        Xt.append(X[idx[:cut]])
        yt.append(y[idx[:cut]])
        Xs.append(X[idx[cut:]])
        ys.append(y[idx[cut:]])
    return ImageTasks(Xs, ys, Xt, yt, np.zeros((len(parts), 0)) if pi is None else pi,
                      num_classes)


def relabelled_mixture(num_clients: int = 24, num_components: int = 3, num_classes: int = 10,
                       samples: int = 200, size: int = 12, split: str = "dirichlet",
                       alpha: float = 0.4, beta: float = 10.0, mix_alpha: float = 0.4,
                       noise: float = 0.6, test_frac: float = 0.2,
                       seed: int = 0) -> ImageTasks:
    """The FedEM setting on generated images (see the module docstring).

    A pool of ``samples * num_clients`` generated images is split among the clients by
    ``split`` (``"dirichlet"``: :func:`dirichlet_label_split` with ``alpha``; ``"pachinko"``:
    :func:`pachinko_split` with coarse labels = pairs of classes, ``alpha`` and ``beta``);
    each client then draws pi ~ Dirichlet(mix_alpha) over the ``num_components`` label
    permutations (the first is the identity) and relabels every sample by the permutation of
    its component. Clients with fewer than 4 samples get 4 more images drawn for them.
    """
    if split not in ("dirichlet", "pachinko"):
        raise ValueError(f"split must be 'dirichlet' or 'pachinko', got {split!r}")
    rng = np.random.default_rng([seed, TAG_IMAGES])
    total = samples * num_clients
    X, base, _ = generated_images(total, num_classes, rng, size=size, noise=noise)
    if split == "dirichlet":
        parts = dirichlet_label_split(base, num_clients, alpha, rng)
    else:
        coarse = base // 2
        parts = pachinko_split(base, coarse, num_clients, alpha, beta, rng)
    perms = np.stack([np.arange(num_classes)] + [rng.permutation(num_classes)
                                                 for _ in range(num_components - 1)])
    pis = rng.dirichlet(np.full(num_components, mix_alpha), size=num_clients)
    labels = base.copy()
    for k, idx in enumerate(parts):
        z = rng.choice(num_components, size=idx.size, p=pis[k])
        labels[idx] = perms[z, base[idx]]
    short = [k for k, idx in enumerate(parts) if idx.size < 4]
    if short:  # top up tiny clients so that each has a train and a test sample
        extra_X, extra_base, _ = generated_images(4 * len(short), num_classes, rng, size=size,
                                                  noise=noise)
        X = np.concatenate([X, extra_X])
        extra = extra_base.copy()
        for j, k in enumerate(short):
            sel = slice(4 * j, 4 * j + 4)
            z = rng.choice(num_components, size=4, p=pis[k])
            extra[sel] = perms[z, extra_base[sel]]
            parts[k] = np.concatenate([parts[k], total + np.arange(4 * j, 4 * j + 4)])
        labels = np.concatenate([labels, extra])
    return train_test_tasks(X, labels, parts, test_frac, rng, num_classes, pis)


# -- local copies of the real datasets -----------------------------------------------------
def find_local_copy(relative: Sequence[str], data_dir: str | Path | None = None) -> Path:
    """The first existing ``dir / r`` over the data directories (or ``data_dir``) and the
    cache, for ``r`` in ``relative``; FileNotFoundError naming every place looked at."""
    bases = [Path(data_dir)] if data_dir is not None else [*default_data_dirs(),
                                                           default_cache_dir()]
    looked = []
    for base in bases:
        for rel in relative:
            path = base / rel
            if path.exists():
                return path
            looked.append(str(path))
    raise FileNotFoundError("no local copy found (nothing is downloaded); looked at: "
                            + ", ".join(looked))


def _unpickle(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")  # the published CIFAR format is a pickle


def load_cifar10(data_dir: str | Path | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """CIFAR-10 from a local ``cifar-10-batches-py/`` (the python version's layout).

    Returns
    -------
    X_train float32 (50000, 3, 32, 32) in [0, 1], y_train int64, X_test, y_test.
    """
    root = find_local_copy(["cifar-10-batches-py", "cifar10/cifar-10-batches-py"], data_dir)

    def read(names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        Xs, ys = [], []
        for name in names:
            batch = _unpickle(root / name)
            Xs.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(batch[b"labels"], dtype=np.int64))
        return np.concatenate(Xs).astype(np.float32) / 255.0, np.concatenate(ys)

    X, y = read([f"data_batch_{i}" for i in range(1, 6)])
    X_test, y_test = read(["test_batch"])
    return X, y, X_test, y_test


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {data.size} bytes for shape {shape}")
    return data.reshape(shape)


def load_emnist(split: str = "byclass", data_dir: str | Path | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """EMNIST ``split`` from the published gzip IDX files (a local copy).

    Images are stored transposed in the published files; they are returned upright, float32
    (n, 1, 28, 28) in [0, 1]. Labels as published (``letters`` starts at 1).
    """
    files = {}
    for part in ("train", "test"):
        for kind, tag in (("images", "images-idx3"), ("labels", "labels-idx1")):
            name = f"emnist-{split}-{part}-{tag}-ubyte.gz"
            files[part, kind] = find_local_copy(
                [f"gzip/{name}", f"emnist/gzip/{name}", f"emnist/{name}", name], data_dir)
    out = []
    for part in ("train", "test"):
        images = _read_idx(files[part, "images"])
        labels = _read_idx(files[part, "labels"]).astype(np.int64)
        if images.ndim != 3 or images.shape[0] != labels.shape[0]:
            raise ValueError(f"EMNIST {split} {part}: images {images.shape}, labels "
                             f"{labels.shape}")
        X = np.ascontiguousarray(images.transpose(0, 2, 1))[:, None].astype(np.float32) / 255.0
        out += [X, labels]
    return out[0], out[1], out[2], out[3]
