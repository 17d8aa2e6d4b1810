"""The synthetic dataset of FedEM (Marfoq et al., NeurIPS 2021), reproduced draw for draw.

This is the generator of the authors' ``data/synthetic/generate_data.py``
(reference_algorithms.md, section 8.6): binary classification tasks whose samples come from a
mixture of ``M`` shared logistic components,

1. task sizes ``n_t = min(int(s_t) + 50, 1000)`` with ``s_t ~ LogNormal(4, 2)`` (one call for
   all tasks);
2. mixture weights ``pi_t ~ Dirichlet(alpha * 1_M)`` (one call per task, in task order);
3. components ``theta`` of shape ``(M, d)`` with ``Uniform(-1, 1)`` entries (one call);
4. for every task in order, its training set (``n_t`` samples) and then its test set
   (``n_test`` samples), each drawn as: counts ``c ~ Multinomial(n, pi_t)``;
   ``X ~ Uniform(-1, 1)^{n x d}``; ``y = 0``; for each component ``k`` in order
   ``eps ~ Normal(0, noise_level)`` of size ``c_k`` and
   ``y[r:r + c_k] = round(sigmoid(X[r:r + c_k] theta_k + eps))``, i.e. ``1[X theta_k + eps > 0]``;
   finally the rows are shuffled by a random permutation (what ``sklearn.utils.shuffle`` does:
   ``idx = arange(n)``, shuffle ``idx`` in place with the same random stream, take rows ``idx``).

All draws come from one ``np.random.RandomState(seed)``, which is the same stream as numpy's
legacy global generator after ``np.random.seed(seed)``, in the order above, so that the
defaults (``seed=12345``, 300 tasks) reproduce the paper's data bit for bit.

The released script has a bug in step 4: the row offset ``r`` never advances, so every
component writes into rows ``0 .. c_k - 1``, later components overwrite earlier ones and rows
``>= max_k c_k`` keep the label 0 whatever ``x`` is (about 26 % of the training rows with the
paper's settings). ``generator="released"`` keeps the bug (faithful to the data the paper's
results were obtained on); ``generator="fixed"`` advances ``r`` by ``c_k`` (faithful to the
mixture the paper describes). Both consume exactly the same random numbers, so their ``X``,
mixture weights and components are identical; only the labels differ.

Labels are ``float64`` in ``{0, 1}`` (FedEM's convention, design decision 9). There is no
intercept column in ``X``; the FedEM models add their own bias.

Memory: the paper setting holds 300 test sets of 5000 x 150 float64 values (1.8 GB).
:func:`iter_fedem_synthetic` yields the tasks one at a time for callers that do not need them
all at once; :func:`make_fedem_synthetic` collects them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .arguments import takes_arguments_of

__all__ = [
    "FEDEM_GENERATORS",
    "FedEMSynthetic",
    "FedEMSyntheticSample",
    "FedEMSyntheticStream",
    "FedEMSyntheticTask",
    "iter_fedem_synthetic",
    "make_fedem_synthetic",
]

#: Accepted values of ``generator``: the authors' released code (row offset never advanced)
#: and the described mixture (row offset advanced by each component's count).
FEDEM_GENERATORS: tuple[str, ...] = ("released", "fixed")

#: Constants of the authors' script: the box of ``X`` and ``theta``, and the size bounds.
_BOX = (-1.0, 1.0)
_SIZE_LOG_MEAN = 4.0
_SIZE_LOG_SIGMA = 2.0
_MIN_SAMPLES = 50
_MAX_SAMPLES = 1000
_MAX_SEED = 2**32 - 1


class FedEMSyntheticSample(NamedTuple):
    """One generated sample (the training or the test set of one task).

    Attributes
    ----------
    X : np.ndarray
        C-contiguous float64 design matrix, shape ``(n, d)``, rows in the final (shuffled)
        order.
    y : np.ndarray
        float64 labels in ``{0, 1}``, shape ``(n,)``.
    counts : np.ndarray
        int64 multinomial draw ``c``, shape ``(M,)``: how many of the ``n`` rows belong to
        each component (``counts.sum() == n``).
    order : np.ndarray
        int64 permutation, shape ``(n,)``: row ``i`` of ``X`` / ``y`` is row ``order[i]`` of
        the sample before the shuffle, where component ``k``'s block is rows
        ``r_k .. r_k + c_k - 1`` (``r_k = 0`` for ``"released"``, ``sum(c[:k])`` for
        ``"fixed"``).
    """

    X: np.ndarray
    y: np.ndarray
    counts: np.ndarray
    order: np.ndarray


class FedEMSyntheticTask(NamedTuple):
    """Training and test samples of one task, as yielded by :func:`iter_fedem_synthetic`.

    Attributes
    ----------
    task : int
        Task index ``t`` (0-based).
    train : FedEMSyntheticSample
        The ``n_t`` training samples.
    test : FedEMSyntheticSample
        The ``n_test`` test samples.
    """

    task: int
    train: FedEMSyntheticSample
    test: FedEMSyntheticSample


class FedEMSyntheticStream(NamedTuple):
    """The task-independent draws and a single-pass iterator over the tasks.

    Attributes
    ----------
    train_sizes : np.ndarray
        int64 training-set sizes ``n_t``, shape ``(T,)``.
    mixture_weights : np.ndarray
        float64 ``pi``, shape ``(T, M)``; each row sums to 1.
    components : np.ndarray
        float64 ``theta``, shape ``(M, d)``.
    tasks : Iterator[FedEMSyntheticTask]
        Yields the tasks in order ``0 .. T - 1``; it can be consumed once (the draws come
        from one random stream), and a task's arrays are not referenced by the iterator
        once yielded.
    """

    train_sizes: np.ndarray
    mixture_weights: np.ndarray
    components: np.ndarray
    tasks: Iterator[FedEMSyntheticTask]


@dataclass(frozen=True, eq=False)
class FedEMSynthetic:
    """The FedEM synthetic dataset (all tasks in memory).

    Parameters
    ----------
    tasks : list of tuple
        One ``(X_train, y_train, X_test, y_test)`` per task: C-contiguous float64 design
        matrices ``(n_t, d)`` / ``(n_test, d)`` and float64 labels in ``{0, 1}``.
    mixture_weights : np.ndarray
        float64 ``(T, M)`` mixture weights ``pi_t``.
    components : np.ndarray
        float64 ``(M, d)`` component parameters ``theta_k``.
    generator : {"released", "fixed"}
        Which labelling was used (see the module docstring).
    seed : int
        Seed of the random stream.
    """

    tasks: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
    mixture_weights: np.ndarray
    components: np.ndarray
    generator: str
    seed: int

    @property
    def num_tasks(self) -> int:
        """Number of tasks ``T``."""
        return len(self.tasks)

    @property
    def num_components(self) -> int:
        """Number of mixture components ``M``."""
        return int(self.components.shape[0])

    @property
    def dim(self) -> int:
        """Number of features ``d``."""
        return int(self.components.shape[1])

    @property
    def train_sizes(self) -> np.ndarray:
        """Per-task training sizes ``n_t``, int64 array of shape ``(T,)``."""
        return np.array([task[0].shape[0] for task in self.tasks], dtype=np.int64)


def _positive_int(value: Any, arg: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{arg} must be a positive int, got {value!r}")
    return int(value)


def _real(value: Any, arg: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{arg} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{arg} must be finite, got {value!r}")
    return v


def _check_generator(generator: Any) -> str:
    """Return ``generator`` if it is one of :data:`FEDEM_GENERATORS`, else raise ValueError."""
    if not isinstance(generator, str) or generator not in FEDEM_GENERATORS:
        raise ValueError(
            f"generator must be one of {list(FEDEM_GENERATORS)} ('released': the authors' "
            f"code, row offset never advanced; 'fixed': the described mixture), "
            f"got {generator!r}"
        )
    return generator


class _Params(NamedTuple):
    num_tasks: int
    num_components: int
    dim: int
    noise_level: float
    n_test: int
    alpha: float
    seed: int
    generator: str


def _check_params(
    num_tasks: Any,
    num_components: Any,
    dim: Any,
    noise_level: Any,
    n_test: Any,
    alpha: Any,
    seed: Any,
    generator: Any,
) -> _Params:
    num_tasks = _positive_int(num_tasks, "num_tasks")
    num_components = _positive_int(num_components, "num_components")
    dim = _positive_int(dim, "dim")
    noise_level = _real(noise_level, "noise_level")
    if noise_level < 0.0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level!r}")
    n_test = _positive_int(n_test, "n_test")
    alpha = _real(alpha, "alpha")
    if alpha <= 0.0:
        raise ValueError(f"alpha must be > 0, got {alpha!r}")
    if (
        isinstance(seed, bool)
        or not isinstance(seed, int | np.integer)
        or not 0 <= seed <= _MAX_SEED
    ):
        raise ValueError(f"seed must be an int in [0, 2**32 - 1], got {seed!r}")
    generator = _check_generator(generator)
    return _Params(num_tasks, num_components, dim, noise_level, n_test, alpha, int(seed), generator)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    # Same expression as the authors' script, so that round(sigmoid(z)) matches it exactly
    # (it equals 1[z > 0] except for |z| below about 1e-16, where sigmoid rounds to 0.5 -> 0).
    return 1.0 / (1.0 + np.exp(-z))


def _draw_sample(
    rng: np.random.RandomState,
    n: int,
    weights: np.ndarray,
    components: np.ndarray,
    noise_level: float,
    advance: bool,
) -> FedEMSyntheticSample:
    """Draw one sample of ``n`` rows of a task with mixture ``weights`` (step 4)."""
    counts = np.asarray(rng.multinomial(n, weights), dtype=np.int64)
    X = rng.uniform(_BOX[0], _BOX[1], size=(n, components.shape[1]))
    y = np.zeros(n)
    start = 0
    for k in range(components.shape[0]):
        c = int(counts[k])
        block = slice(start, start + c)
        z = X[block] @ components[k]
        eps = rng.normal(scale=noise_level, size=c)
        y[block] = np.round(_sigmoid(z + eps))
        if advance:
            start += c
    order = np.arange(n)
    rng.shuffle(order)
    return FedEMSyntheticSample(X[order], y[order], counts, order)


def _iter_tasks(
    rng: np.random.RandomState,
    params: _Params,
    sizes: np.ndarray,
    weights: np.ndarray,
    components: np.ndarray,
) -> Iterator[FedEMSyntheticTask]:
    advance = params.generator == "fixed"
    for t in range(params.num_tasks):
        train = _draw_sample(
            rng, int(sizes[t]), weights[t], components, params.noise_level, advance
        )
        test = _draw_sample(rng, params.n_test, weights[t], components, params.noise_level, advance)
        yield FedEMSyntheticTask(t, train, test)


def iter_fedem_synthetic(
    num_tasks: int = 300,
    *,
    num_components: int = 3,
    dim: int = 150,
    noise_level: float = 0.1,
    n_test: int = 5000,
    alpha: float = 0.4,
    seed: int = 12345,
    generator: str = "released",
) -> FedEMSyntheticStream:
    """Draw the task-independent parts now and return an iterator over the tasks.

    Same arguments and random stream as :func:`make_fedem_synthetic`; use this to process
    the paper-sized dataset (1.8 GB of test data) one task at a time. The sizes, mixture
    weights and components are drawn before this function returns; each task is drawn when
    the iterator reaches it.

    Parameters
    ----------
    num_tasks, num_components, dim, noise_level, n_test, alpha, seed, generator
        As for :func:`make_fedem_synthetic`.

    Returns
    -------
    FedEMSyntheticStream
        ``(train_sizes, mixture_weights, components, tasks)``; ``tasks`` yields
        :class:`FedEMSyntheticTask` records (with each sample's multinomial counts and shuffle
        order besides ``X`` and ``y``) and can be consumed once.

    Raises
    ------
    ValueError
        As for :func:`make_fedem_synthetic`.
    """
    params = _check_params(
        num_tasks, num_components, dim, noise_level, n_test, alpha, seed, generator
    )
    rng = np.random.RandomState(params.seed)
    # 1. sizes: int() truncation of the log-normal draws, + 50, capped at 1000 (capping the
    #    float first only avoids an int64 overflow on an astronomically large draw).
    raw = rng.lognormal(_SIZE_LOG_MEAN, _SIZE_LOG_SIGMA, params.num_tasks)
    sizes = np.minimum(
        np.floor(np.minimum(raw, float(_MAX_SAMPLES))).astype(np.int64) + _MIN_SAMPLES,
        _MAX_SAMPLES,
    )
    # 2. mixture weights, one Dirichlet call per task
    concentration = np.full(params.num_components, params.alpha)
    weights = np.empty((params.num_tasks, params.num_components))
    for t in range(params.num_tasks):
        weights[t] = rng.dirichlet(concentration)
    # 3. components, one call
    components = rng.uniform(_BOX[0], _BOX[1], size=(params.num_components, params.dim))
    # the iterator keeps its own copies, so that changing the returned arrays cannot change
    # the tasks still to come
    tasks = _iter_tasks(rng, params, sizes.copy(), weights.copy(), components.copy())
    return FedEMSyntheticStream(sizes, weights, components, tasks)


@takes_arguments_of(iter_fedem_synthetic)
def make_fedem_synthetic(**arguments: Any) -> FedEMSynthetic:
    """Generate FedEM's synthetic mixture dataset (the defaults are the paper's settings).

    Parameters
    ----------
    num_tasks : int, default 300
        Number of tasks ``T`` (positive). As in the authors' script, every draw after the
        sizes depends on it: the first tasks of a smaller instance are not those of the
        300-task one.
    num_components : int, default 3
        Number of mixture components ``M`` (positive).
    dim : int, default 150
        Number of features ``d`` (positive).
    noise_level : float, default 0.1
        Standard deviation of the logit noise ``eps`` (finite, >= 0).
    n_test : int, default 5000
        Test samples per task (positive). It changes the random stream of every later task,
        hence all tasks but the first's training set.
    alpha : float, default 0.4
        Dirichlet concentration of the mixture weights (finite, > 0); smaller is more
        heterogeneous.
    seed : int, default 12345
        Seed of ``np.random.RandomState`` (the legacy global stream), in ``[0, 2**32 - 1]``.
    generator : {"released", "fixed"}, default "released"
        ``"released"`` reproduces the authors' code including its row-offset bug (rows
        ``>= max_k c_k`` of every sample are labelled 0); ``"fixed"`` labels every row with
        the component it was drawn for. See the module docstring.

    Returns
    -------
    FedEMSynthetic
        Training sizes ``n_t`` in ``[50, 1000]``; labels float64 in ``{0, 1}``.

    Raises
    ------
    ValueError
        Naming the argument, if an argument has the wrong type or is out of range, or if
        ``generator`` is not one of :data:`FEDEM_GENERATORS`.
    """
    stream = iter_fedem_synthetic(**arguments)
    tasks = [(task.train.X, task.train.y, task.test.X, task.test.y) for task in stream.tasks]
    return FedEMSynthetic(
        tasks=tasks,
        mixture_weights=stream.mixture_weights,
        components=stream.components,
        generator=arguments["generator"],
        seed=int(arguments["seed"]),
    )
