"""Sparse, unbalanced, non-IID federated data in the style of the FSVRG paper (section 4.1).

The paper's data (public Google+ posts of 10,000 authors, bag of words, "will this post get a
comment?") cannot be released; this generator mimics its structure:

* **Nodes** (authors): ``n_k`` (all rows, before the split) is a Pareto(``size_alpha`` = 1.2)
  draw ``>= size_min`` (40), capped at ``size_max`` (12,000), so the training sizes span
  30 .. 9,000 (the paper's: 75 .. 9,000; median 50, mean 126 .. 150).
* **Features** (``d = dim``, default 20,000, the paper's 20,002): feature 0 is a bias (1 in
  every row), feature 1 an "unknown word" (in a node-specific fraction of the rows, on almost
  every node), features ``2 .. d-1`` are words ranked by global frequency (Zipf,
  exponent ``zipf`` = 1). A post has ``1 + Poisson(words_per_row)`` word tokens (binary
  features: word present). Per-node vocabularies: word ``j`` belongs to topic
  ``(j - 2) mod num_topics``; a node follows ``1 + Poisson(topics_mean - 1)`` topics (topic
  popularity is Zipf: a few are followed by many nodes, most by few), and each token is,
  with probability ``topic_prob``, a word of one of its topics (Zipf within the topic),
  otherwise a word of the whole vocabulary. So a few features are present everywhere and
  most on few nodes (figures below).
* **Labels** ``y in {-1, +1}``: ``P(y = +1) = sigmoid(x^T w* + b_k)`` with word weights
  ``w*_j ~ N(0, word_weight^2)`` and a strong per-node bias ``b_k ~ N(bias_mean,
  bias_std^2)``, so "who wrote it" predicts better than "what was written": a per-node
  majority vote beats the best global linear model, which beats predicting -1, as in the
  paper (17.14 % < 26.27 % < 33.16 %).
* **Split**: per node, a random ``test_frac`` of the rows (at least one row is kept for
  training; the paper split chronologically, 75/25).
* **IID** (``iid=True``, the paper's FSVRGR): the same training rows reshuffled uniformly
  across the same training-set sizes (and the test rows across the same test sizes).

Randomness is explicit: the shared structure (word weights, topics, popularities) comes from
``default_rng([seed, 0x5F0])``, node ``t`` from ``default_rng([seed, t, 0x5F1])`` (so node
``t`` is the same for every ``num_tasks``: the K = 10,000 federation extends the K = 1,000
one), the IID reshuffle from ``default_rng([seed, 0x5F2])``. The non-IID nodes are generated
one at a time (:func:`make_sparse_task`, :class:`SparseTaskSource`), so a process can build
just the node it serves, and a large non-IID federation can be lazy
(:mod:`fmtl_flower.data.lazy`: node ``t`` generated when accessed). ``iid=True`` needs them
all: the reshuffle is one permutation of all the pooled rows, so node ``k``'s rows come from
about ``n_k`` different nodes; the IID federation is always built whole.

Containers: :class:`SparseTaskData` / :class:`SparseFederatedDataset` mirror
:class:`~fmtl_flower.data.dataset.TaskData` / :class:`~fmtl_flower.data.dataset.MultiTaskDataset`
(same attribute and method names: ``X_train``, ``y_train``, ``X_test``, ``y_test``, ``n_train``,
``n_test``, ``dim``, ``arrays()``, ``tasks``, ``num_tasks``, ``task(t)``, ``pooled_train()``,
``pooled_test()``) but hold ``scipy.sparse.csr_matrix`` design matrices (float64 data, int32
indices, sorted, no duplicates); the dense containers are unchanged.

Figures for the defaults (seed 0, d = 20,000, measured), K = 1,000 | K = 10,000:

* training / test rows: 150,395 / 50,114 | 1,260,009 / 419,841;
* training n_k min / median / mean / max: 30 / 50.5 / 150 / 9000 | 30 / 53 / 126 / 9000;
* nonzeros per row 11.6 (density 5.8e-4); features present on every node: 3; features
  present on < 10 % of the nodes: 96 % (median number of nodes per feature 10 | 87; the
  paper: 88 % on < 1,000 of 10,000 nodes);
* arrays (CSR + labels): 30 MB | 253 MB; generation on one core: 1.4 s | 12.5 s, peak RSS
  150 MB | 380 MB (``iid=True``: 16 s, 810 MB, the reshuffle pools the rows);
* test error of the naive predictors, all -1 / global optimum (``lam = 1/n``, scikit-learn
  on the pooled rows) / per-node majority: 33.0 / 26.4 / 17.8 % | 36.1 / 31.9 / 15.0 %
  (the paper: 33.16 / 26.27 / 17.14 %); with ``iid=True`` the majority vote is no better than
  all -1 (36.3 % at K = 10,000).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fmtl_flower._lazy import lazy_module

from ..core.rng import TAG_SPARSE_GLOBAL, TAG_SPARSE_IID, TAG_SPARSE_TASK
from .dataset import TaskCollection, TrainTestParts

sp = lazy_module("scipy.sparse")  # loaded when a sparse dataset is built

__all__ = [
    "SPARSE_DEFAULTS",
    "SparseFederatedDataset",
    "SparseTaskData",
    "SparseTaskSource",
    "make_sparse_federated",
    "make_sparse_task",
    "sparse_task_source",
    "majority_vote_error",
    "constant_error",
    "linear_model_error",
]

_GLOBAL_TAG = TAG_SPARSE_GLOBAL
_TASK_TAG = TAG_SPARSE_TASK
_IID_TAG = TAG_SPARSE_IID

#: Default shape parameters of the generator (keyword arguments of :func:`make_sparse_task`).
SPARSE_DEFAULTS: dict[str, Any] = {
    "size_min": 40,
    "size_max": 12_000,
    "size_alpha": 1.2,
    "zipf": 1.0,
    "num_topics": 200,
    "topics_mean": 2.0,
    "topic_prob": 0.5,
    "words_per_row": 10.0,
    "word_weight": 0.9,
    "bias_mean": -2.2,
    "bias_std": 6.0,
}


# --------------------------------------------------------------------------------------------
# containers


def _check_csr(X: Any, what: str) -> sp.csr_matrix:
    if not (sp.issparse(X) and X.format == "csr"):
        raise TypeError(f"{what} must be a scipy.sparse CSR matrix, got {type(X).__name__}")
    if X.ndim != 2:
        raise ValueError(f"{what} must be 2-D, got shape {X.shape}")
    if X.dtype != np.float64:
        raise ValueError(f"{what} must have float64 data, got {X.dtype}")
    return X


def _check_pm1(y: np.ndarray, what: str) -> None:
    if np.size(y) and not np.all(np.abs(np.asarray(y)) == 1.0):
        raise ValueError(f"{what} must be in {{-1, +1}}")


@dataclass(frozen=True, eq=False)
class SparseTaskData(TrainTestParts["sp.csr_matrix"]):  # a string: scipy stays unloaded
    """Train and test data of one node, with CSR design matrices.

    Parameters
    ----------
    X_train : scipy.sparse.csr_matrix
        ``(n_train, d)``, float64.
    y_train : np.ndarray
        ``(n_train,)``, float64 in {-1, +1}.
    X_test : scipy.sparse.csr_matrix
        ``(n_test, d)``, float64 (``n_test`` may be 0).
    y_test : np.ndarray
        ``(n_test,)``.

    Raises
    ------
    TypeError
        If a design matrix is not CSR.
    ValueError
        If shapes are inconsistent or the labels are not in {-1, +1}.
    """

    X_train: sp.csr_matrix
    y_train: np.ndarray
    X_test: sp.csr_matrix
    y_test: np.ndarray

    def __post_init__(self) -> None:
        self._check_parts(_check_csr, _check_pm1)

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (CSR data, indices, indptr and labels)."""
        return sum(_csr_nbytes(X) for X in (self.X_train, self.X_test)) + int(
            self.y_train.nbytes + self.y_test.nbytes)


def _csr_nbytes(X: sp.csr_matrix) -> int:
    return int(X.data.nbytes + X.indices.nbytes + X.indptr.nbytes)


@dataclass(frozen=True, eq=False)
class SparseFederatedDataset(TaskCollection):
    """A named collection of sparse nodes (tasks) sharing ``d``; the sparse counterpart of
    :class:`~fmtl_flower.data.dataset.MultiTaskDataset`.

    Parameters
    ----------
    name : str
        Dataset name (``"sparse-federated"``).
    tasks : tuple of SparseTaskData
        One per node; node (task) ids are the positions ``0 .. K - 1``.
    iid : bool, default False
        Whether the rows were reshuffled IID across the nodes (FSVRGR).
    params : dict
        The generator's arguments (for the record).
    """

    name: str
    tasks: tuple[SparseTaskData, ...]
    iid: bool = False
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._store_tasks(SparseTaskData)

    @property
    def nbytes(self) -> int:
        """Bytes held by all arrays."""
        return sum(t.nbytes for t in self.tasks)

    def pooled_train(self) -> tuple[sp.csr_matrix, np.ndarray]:
        """All training rows, node 0 first: ``(X (n, d) CSR, y (n,))``."""
        return _stack_sparse(*self._parts("train"))

    def pooled_test(self) -> tuple[sp.csr_matrix, np.ndarray]:
        """All test rows, node 0 first."""
        return _stack_sparse(*self._parts("test"))


def _stack_sparse(
    Xs: Sequence[sp.csr_matrix], ys: Sequence[np.ndarray]
) -> tuple[sp.csr_matrix, np.ndarray]:
    """Vertically stack CSR design matrices and concatenate labels."""
    return sp.vstack(Xs, format="csr"), np.concatenate(ys)


# --------------------------------------------------------------------------------------------
# the generator


def _check_int(value: Any, arg: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{arg} must be an int >= {low}, got {value!r}")
    return int(value)


def size_params(samples_per_task: int) -> dict[str, int]:
    """Node-size arguments giving a median of about ``samples_per_task`` rows per node (before
    the split): Pareto(alpha) >= size_min has median size_min 2^(1/alpha), so
    size_min = samples_per_task / 2^(1/alpha) (at least 2), and size_max keeps the default
    ratio size_max / size_min = 300."""
    s = _check_int(samples_per_task, "samples_per_task", 2)
    alpha = SPARSE_DEFAULTS["size_alpha"]
    size_min = max(2, round(s / 2.0 ** (1.0 / alpha)))
    ratio = SPARSE_DEFAULTS["size_max"] // SPARSE_DEFAULTS["size_min"]
    return {"size_min": size_min, "size_max": ratio * size_min}


def _check_params(dim: int, params: dict[str, Any]) -> dict[str, Any]:
    unknown = set(params) - set(SPARSE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown generator arguments {sorted(unknown)}; "
                         f"known: {sorted(SPARSE_DEFAULTS)}")
    p = {**SPARSE_DEFAULTS, **params}
    for key in ("size_min", "size_max", "num_topics"):
        p[key] = _check_int(p[key], key, 1)
    if p["size_max"] < p["size_min"] or p["size_min"] < 2:
        raise ValueError(f"need 2 <= size_min <= size_max, got {p['size_min']}, {p['size_max']}")
    for key in ("size_alpha", "zipf", "words_per_row", "topics_mean", "word_weight",
                "bias_std"):
        v = float(p[key])
        if not (math.isfinite(v) and v >= 0.0):
            raise ValueError(f"{key} must be finite and >= 0, got {p[key]!r}")
        p[key] = v
    if p["size_alpha"] <= 0.0:
        raise ValueError(f"size_alpha must be > 0, got {p['size_alpha']}")
    p["bias_mean"] = float(p["bias_mean"])
    if not math.isfinite(p["bias_mean"]):
        raise ValueError(f"bias_mean must be finite, got {p['bias_mean']!r}")
    if not 0.0 <= float(p["topic_prob"]) <= 1.0:
        raise ValueError(f"topic_prob must be in [0, 1], got {p['topic_prob']!r}")
    p["topic_prob"] = float(p["topic_prob"])
    if dim < 2 + p["num_topics"]:
        raise ValueError(f"dim = {dim} is too small: need >= 2 + num_topics = "
                         f"{2 + p['num_topics']}")
    return p


@dataclass(frozen=True)
class _Shared:
    """What all nodes share: word weights and the vocabulary's structure."""

    w_star: np.ndarray  # (d,)
    word_cdf: np.ndarray  # (d - 2,) cumulative Zipf over the words (feature j = rank + 1)
    topic_cdf: np.ndarray  # (num_topics,) cumulative Zipf popularity of the topics
    in_topic_cdf: np.ndarray  # (M,) cumulative Zipf over a topic's words, by rank in topic


_SHARED_CACHE: dict[tuple[int, int, tuple[tuple[str, Any], ...]], _Shared] = {}


def _zipf_cdf(size: int, exponent: float) -> np.ndarray:
    w = np.arange(1, size + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(w)
    return cdf / cdf[-1]


def _shared(seed: int, dim: int, p: dict[str, Any]) -> _Shared:
    key = (seed, dim, tuple(sorted(p.items())))
    cached = _SHARED_CACHE.get(key)
    if cached is not None:
        return cached
    rng = np.random.default_rng([seed, _GLOBAL_TAG])
    w_star = p["word_weight"] * rng.standard_normal(dim)
    w_star[0] = 0.0  # the intercept is the node's bias b_k
    w_star[1] *= 0.5
    topics = p["num_topics"]
    topic_pop = np.arange(1, topics + 1, dtype=np.float64) ** -1.0
    rng.shuffle(topic_pop)
    out = _Shared(w_star, _zipf_cdf(dim - 2, p["zipf"]), np.cumsum(topic_pop) / topic_pop.sum(),
                  _zipf_cdf((dim - 2) // topics, p["zipf"]))
    if len(_SHARED_CACHE) > 8:
        _SHARED_CACHE.clear()
    _SHARED_CACHE[key] = out
    return out


def _draw(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF sampling: indices into ``cdf`` for uniforms ``u``."""
    return np.minimum(np.searchsorted(cdf, u, side="right"), cdf.shape[0] - 1)


def _node_rows(t: int, seed: int, dim: int, p: dict[str, Any],
               sh: _Shared) -> tuple[sp.csr_matrix, np.ndarray, np.random.Generator]:
    """All rows of node ``t`` (before the split) and its generator (for the split)."""
    rng = np.random.default_rng([seed, t, _TASK_TAG])
    # size: Pareto(alpha) >= size_min, capped
    u = 1.0 - rng.random()
    m = int(min(p["size_max"], math.floor(p["size_min"] * u ** (-1.0 / p["size_alpha"]))))
    # the node's topics (its vocabulary): Zipf popularity, without repetition
    num_topics = sh.topic_cdf.shape[0]
    n_top = min(num_topics, 1 + int(rng.poisson(max(p["topics_mean"] - 1.0, 0.0))))
    topics = np.unique(_draw(sh.topic_cdf, rng.random(8 * n_top + 8)))[:n_top]
    # rows: 1 + Poisson word tokens; a token is a topic word with probability topic_prob
    # (topic c owns the words of global rank c + 1, c + 1 + T, ...; Zipf within the topic),
    # else a word of the whole vocabulary (Zipf by global rank)
    lengths = 1 + rng.poisson(p["words_per_row"], size=m)
    total = int(lengths.sum())
    from_topic = rng.random(total) < p["topic_prob"]
    u_tok = rng.random(total)
    cols = np.empty(total, dtype=np.int64)
    k = int(from_topic.sum())
    topic_of = topics[rng.integers(0, topics.size, size=k)]
    cols[from_topic] = 2 + topic_of + num_topics * _draw(sh.in_topic_cdf, u_tok[from_topic])
    cols[~from_topic] = 2 + _draw(sh.word_cdf, u_tok[~from_topic])
    unknown_rate = rng.beta(2.0, 5.0)
    has_unknown = rng.random(m) < unknown_rate
    row_ids = np.concatenate([np.arange(m), np.flatnonzero(has_unknown),
                              np.repeat(np.arange(m), lengths)])
    col_ids = np.concatenate([np.zeros(m, dtype=np.int64),
                              np.ones(int(has_unknown.sum()), dtype=np.int64), cols])
    X = sp.csr_matrix((np.ones(row_ids.size), (row_ids, col_ids)), shape=(m, dim))
    X.sum_duplicates()
    X.data[:] = 1.0  # binary: word present
    X.indices = X.indices.astype(np.int32, copy=False)
    X.indptr = X.indptr.astype(np.int32, copy=False)
    # labels
    b_k = p["bias_mean"] + p["bias_std"] * rng.standard_normal()
    z = np.asarray(X @ sh.w_star).reshape(-1) + b_k
    prob = 0.5 * (1.0 + np.tanh(0.5 * z))  # sigmoid, overflow-free
    y = np.where(rng.random(m) < prob, 1.0, -1.0)
    return X, y, rng


def _split(X: sp.csr_matrix, y: np.ndarray, test_frac: float,
           rng: np.random.Generator) -> SparseTaskData:
    m = X.shape[0]
    n_test = min(int(round(test_frac * m)), m - 1)
    test = np.zeros(m, dtype=bool)
    if n_test > 0:
        test[rng.choice(m, size=n_test, replace=False)] = True
    train = ~test
    return SparseTaskData(X[train], y[train], X[test], y[test])


def make_sparse_task(
    t: int,
    *,
    dim: int = 20_000,
    seed: int = 0,
    test_frac: float = 0.25,
    **params: Any,
) -> SparseTaskData:
    """Generate node ``t`` of the (non-IID) federation, independently of all other nodes.

    Parameters
    ----------
    t : int
        Node id (>= 0).
    dim : int, default 20000
        Number of features ``d``.
    seed : int, default 0
        Non-negative seed.
    test_frac : float, default 0.25
        Fraction of the node's rows held out for testing, in [0, 1).
    **params
        Shape parameters, defaults in :data:`SPARSE_DEFAULTS` (see the module docstring).

    Returns
    -------
    SparseTaskData
        Node ``t`` of :func:`sparse_task_source` (any ``num_tasks > t``) with the same
        arguments.
    """
    t = _check_int(t, "t", 0)
    return sparse_task_source(t + 1, dim=dim, seed=seed, test_frac=test_frac, **params)(t)


def _reshuffle(tasks: Sequence[SparseTaskData], seed: int) -> list[SparseTaskData]:
    """The same rows, permuted uniformly across nodes of the same train/test sizes."""
    rng = np.random.default_rng([seed, _IID_TAG])
    parts: dict[str, tuple[list[sp.csr_matrix], list[np.ndarray]]] = {}
    for part in ("train", "test"):
        X = sp.vstack([getattr(t, f"X_{part}") for t in tasks], format="csr")
        y = np.concatenate([getattr(t, f"y_{part}") for t in tasks])
        perm = rng.permutation(X.shape[0])
        X, y = X[perm], y[perm]
        bounds = np.concatenate([[0], np.cumsum([getattr(t, f"n_{part}") for t in tasks])])
        parts[part] = ([X[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)],
                       [y[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    return [SparseTaskData(parts["train"][0][k], parts["train"][1][k], parts["test"][0][k],
                           parts["test"][1][k]) for k in range(len(tasks))]


def make_sparse_federated(
    num_tasks: int = 1000,
    *,
    dim: int = 20_000,
    seed: int = 0,
    test_frac: float = 0.25,
    iid: bool = False,
    name: str = "sparse-federated",
    **params: Any,
) -> SparseFederatedDataset:
    """Generate the federation: nodes ``0 .. num_tasks - 1`` (:func:`make_sparse_task`).

    Parameters
    ----------
    num_tasks : int, default 1000
        Number of nodes ``K``.
    dim, seed, test_frac, **params
        As for :func:`make_sparse_task`.
    iid : bool, default False
        Reshuffle the rows IID across the same node sizes (the paper's FSVRGR): train rows
        among the training sets, test rows among the test sets, one uniform permutation each.
    name : str, default "sparse-federated"

    Returns
    -------
    SparseFederatedDataset
    """
    if not isinstance(iid, bool | np.bool_):
        raise ValueError(f"iid must be a bool, got {iid!r}")
    source = sparse_task_source(num_tasks, dim=dim, seed=seed, test_frac=test_frac, **params)
    tasks = [source(t) for t in range(source.num_tasks)]
    if iid:
        tasks = _reshuffle(tasks, source.seed)
    return SparseFederatedDataset(name, tuple(tasks), bool(iid), source.record())


@dataclass(frozen=True, eq=False)
class SparseTaskSource:
    """Node ``t`` of a non-IID federation on demand: ``source(t) -> SparseTaskData``.

    Built (and validated) by :func:`sparse_task_source`. Node ``t`` depends only on the shared
    structure (:class:`_Shared`, ``O(d)``) and on ``default_rng([seed, t, 0x5F1])``, so
    ``source(t)`` is bit-identical to node ``t`` of :func:`make_sparse_federated` with
    ``iid=False`` (which is ``[source(t) for t in range(num_tasks)]``). The IID reshuffle has no
    per-node form: node ``k``'s rows are positions of one permutation of all the pooled rows,
    drawn from every node.
    """

    num_tasks: int
    dim: int
    seed: int
    test_frac: float
    params: dict[str, Any]
    shared: _Shared

    def __call__(self, t: int) -> SparseTaskData:
        t = _check_int(t, "t", 0)
        if t >= self.num_tasks:
            raise IndexError(f"node id {t} out of range 0..{self.num_tasks - 1}")
        X, y, rng = _node_rows(t, self.seed, self.dim, self.params, self.shared)
        return _split(X, y, self.test_frac, rng)

    def record(self) -> dict[str, Any]:
        """The generator's arguments (``SparseFederatedDataset.params``)."""
        return {"num_tasks": self.num_tasks, "dim": self.dim, "seed": self.seed,
                "test_frac": self.test_frac, **self.params}


def sparse_task_source(
    num_tasks: int = 1000,
    *,
    dim: int = 20_000,
    seed: int = 0,
    test_frac: float = 0.25,
    **params: Any,
) -> SparseTaskSource:
    """Validate the arguments of :func:`make_sparse_federated` (non-IID) and return its
    per-node source (see :class:`SparseTaskSource`)."""
    num_tasks = _check_int(num_tasks, "num_tasks", 1)
    dim = _check_int(dim, "dim", 1)
    seed = _check_int(seed, "seed", 0)
    if isinstance(test_frac, bool) or not 0.0 <= float(test_frac) < 1.0:
        raise ValueError(f"test_frac must be in [0, 1), got {test_frac!r}")
    p = _check_params(dim, params)
    return SparseTaskSource(num_tasks, dim, seed, float(test_frac), p, _shared(seed, dim, p))


# --------------------------------------------------------------------------------------------
# the paper's naive predictors (section 4.1), on the pooled test rows


def constant_error(dataset: SparseFederatedDataset, label: float = -1.0) -> float:
    """Test error of predicting ``label`` everywhere (the paper's "all -1": 33.16 %)."""
    y = np.concatenate([t.y_test for t in dataset.tasks])
    return float(np.mean(y != label)) if y.size else float("nan")


def majority_vote_error(dataset: SparseFederatedDataset) -> float:
    """Test error of predicting each node's training majority label (ties: -1) on its test
    rows (the paper's "per-author majority": 17.14 %)."""
    wrong = 0
    total = 0
    for t in dataset.tasks:
        label = 1.0 if np.sum(t.y_train) > 0 else -1.0
        wrong += int(np.sum(t.y_test != label))
        total += t.n_test
    return wrong / total if total else float("nan")


def linear_model_error(dataset: SparseFederatedDataset, w: Any) -> float:
    """Pooled test error of ``sign(x^T w)`` (0 counts as -1), e.g. for the global optimum
    (the paper's 26.27 %)."""
    wa = np.asarray(w, dtype=np.float64).reshape(-1)
    wrong = 0
    total = 0
    for t in dataset.tasks:
        pred = np.where(np.asarray(t.X_test @ wa).reshape(-1) > 0, 1.0, -1.0)
        wrong += int(np.sum(pred != t.y_test))
        total += t.n_test
    return wrong / total if total else float("nan")
