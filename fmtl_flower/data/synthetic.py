"""MOCHA-style generator of related linear classification tasks.

Tasks come in clusters. Cluster ``c`` has a centre direction ``u_c``; task ``t`` belongs to
cluster ``t mod num_clusters`` and has the weight vector ``w_t = u_c + task_noise * e_t``
(``e_t`` a random direction scaled to unit expected norm). Its labels are
``y = sign(X w_t)`` with a fraction ``label_noise`` of them flipped.

* The cluster centres are drawn as ``N(0, I_d)`` vectors, centred across clusters (so they
  sum to zero) and normalised to unit length. Centring makes the clusters conflict: one
  global linear model fits no cluster well, and with two clusters it is at chance.
* Task sizes are unbalanced: ``n_t`` is log-normal around ``samples_per_task`` and clipped to
  ``[max(10, samples_per_task // 4), 4 * samples_per_task]``.
* There is no intercept (the package's linear models have no bias term).

A model that shares within clusters (MOCHA with a learned task relationship) can beat both
purely local models (few samples per task relative to ``d``) and one global model.

Randomness is explicit (design decision 5): the cluster centres come from
``default_rng([seed, 0x5C])`` and task ``t`` from ``default_rng([seed, t, 0x5E])``, so task
``t`` does not depend on ``num_tasks``. :func:`synthetic_source` returns the per-task
generator (:class:`SyntheticSource`, ``source(t) -> (X_t, y_t)``) that
:func:`make_synthetic_tasks` loops over, so one task can be drawn without the others (the lazy
datasets of :mod:`fmtl_flower.data.lazy`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fmtl_flower.core.rng import TAG_SYNTHETIC_CENTRES, TAG_SYNTHETIC_TASK

from .arguments import takes_arguments_of

__all__ = ["SyntheticSource", "make_synthetic_tasks", "synthetic_source"]

_CENTRE_TAG = TAG_SYNTHETIC_CENTRES
_TASK_TAG = TAG_SYNTHETIC_TASK
#: Standard deviation of log(n_t / samples_per_task).
_SIZE_LOG_STD = 0.6
_MAX_DRAWS = 100


def _positive_int(value: Any, arg: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{arg} must be a positive int, got {value!r}")
    return int(value)


def _fraction(value: Any, arg: str, *, upper: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
        raise ValueError(f"{arg} must be a number, got {value!r}")
    v = float(value)
    if not (0.0 <= v < upper):
        raise ValueError(f"{arg} must be in [0, {upper:g}), got {value!r}")
    return v


def _nonnegative(value: Any, arg: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
        raise ValueError(f"{arg} must be a number, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{arg} must be finite and >= 0, got {value!r}")
    return v


def _cluster_centres(num_clusters: int, dim: int, seed: int) -> np.ndarray:
    """Unit-norm, mutually conflicting cluster directions, shape ``(num_clusters, dim)``."""
    rng = np.random.default_rng([seed, _CENTRE_TAG])
    U = rng.standard_normal((num_clusters, dim))
    if num_clusters > 1:
        U -= U.mean(axis=0, keepdims=True)
    norms = np.linalg.norm(U, axis=1, keepdims=True)
    return U / np.maximum(norms, np.finfo(np.float64).tiny)


@dataclass(frozen=True, eq=False)
class SyntheticSource:
    """Task ``t`` of a synthetic federation on demand: ``source(t) -> (X_t, y_t)``.

    Built (and validated) by :func:`synthetic_source`; :func:`make_synthetic_tasks` is
    ``[source(t) for t in range(num_tasks)]`` (:meth:`draw_all`), so a task drawn alone is
    bit-identical to the same task drawn with all the others. Holds only the arguments and
    the cluster centres (``num_clusters x dim``), whatever ``num_tasks``; picklable.
    """

    num_tasks: int
    dim: int
    samples_per_task: int
    num_clusters: int
    task_noise: float
    label_noise: float
    seed: int
    centres: np.ndarray

    def __call__(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Draw task ``t`` (``0 <= t < num_tasks``) from ``default_rng([seed, t, 0x5E])``."""
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise TypeError(f"task id must be an int, got {type(t).__name__}")
        t = int(t)
        if not 0 <= t < self.num_tasks:
            raise IndexError(f"task id {t} out of range 0..{self.num_tasks - 1}")
        dim = self.dim
        n_min = max(10, self.samples_per_task // 4)
        n_max = max(4 * self.samples_per_task, n_min)
        rng = np.random.default_rng([self.seed, t, _TASK_TAG])
        w = self.centres[t % self.num_clusters] + self.task_noise * rng.standard_normal(
            dim
        ) / math.sqrt(dim)
        w /= max(float(np.linalg.norm(w)), np.finfo(np.float64).tiny)
        size = self.samples_per_task * math.exp(_SIZE_LOG_STD * rng.standard_normal())
        n = int(np.clip(round(size), n_min, n_max))
        n_flip = round(self.label_noise * n)
        for _ in range(_MAX_DRAWS):
            X = rng.standard_normal((n, dim))
            y = np.where(X @ w >= 0.0, 1.0, -1.0)
            if n_flip:
                flip = rng.choice(n, size=n_flip, replace=False)
                y[flip] = -y[flip]
            if np.any(y > 0) and np.any(y < 0):
                break
        else:  # pragma: no cover - probability < 2**-(10 * _MAX_DRAWS)
            raise RuntimeError(f"task {t}: could not draw both labels")
        return X, y

    def draw_all(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Draw every task, task 0 first: ``(Xs, ys)`` as :func:`make_synthetic_tasks`
        returns them."""
        Xs: list[np.ndarray] = []
        ys: list[np.ndarray] = []
        for t in range(self.num_tasks):
            X, y = self(t)
            Xs.append(X)
            ys.append(y)
        return Xs, ys


def synthetic_source(
    num_tasks: int = 30,
    dim: int = 20,
    samples_per_task: int = 60,
    num_clusters: int = 3,
    task_noise: float = 0.3,
    label_noise: float = 0.05,
    seed: int = 0,
) -> SyntheticSource:
    """Validate the arguments of :func:`make_synthetic_tasks` and return its per-task source.

    Parameters
    ----------
    num_tasks, dim, samples_per_task, num_clusters, task_noise, label_noise, seed
        As for :func:`make_synthetic_tasks`.

    Returns
    -------
    SyntheticSource
        ``source(t)`` is task ``t`` of ``make_synthetic_tasks(...)`` with the same arguments.

    Raises
    ------
    ValueError
        Naming the argument, if an argument is out of range.
    """
    num_tasks = _positive_int(num_tasks, "num_tasks")
    dim = _positive_int(dim, "dim")
    samples_per_task = _positive_int(samples_per_task, "samples_per_task")
    num_clusters = _positive_int(num_clusters, "num_clusters")
    task_noise = _nonnegative(task_noise, "task_noise")
    label_noise = _fraction(label_noise, "label_noise", upper=0.5)
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    seed = int(seed)
    centres = _cluster_centres(num_clusters, dim, seed)
    centres.setflags(write=False)
    return SyntheticSource(
        num_tasks, dim, samples_per_task, num_clusters, task_noise, label_noise, seed, centres
    )


@takes_arguments_of(synthetic_source)
def make_synthetic_tasks(**arguments: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Generate clustered linear classification tasks.

    Parameters
    ----------
    num_tasks : int, default 30
        Number of tasks ``m`` (positive).
    dim : int, default 20
        Number of features ``d`` (positive).
    samples_per_task : int, default 60
        Median number of samples per task (positive); actual ``n_t`` are log-normal around it,
        clipped to ``[max(10, samples_per_task // 4), 4 * samples_per_task]``.
    num_clusters : int, default 3
        Number of task clusters (positive); task ``t`` is in cluster ``t mod num_clusters``.
    task_noise : float, default 0.3
        Spread of the tasks around their cluster's unit-norm centre (finite, >= 0): the
        deviation is ``task_noise`` times a Gaussian vector with unit expected norm, so
        ``w_t`` is about ``atan(task_noise)`` away from its centre (17 degrees for 0.3).
    label_noise : float, default 0.05
        Fraction of each task's labels that are flipped (``round(label_noise * n_t)``
        labels), in [0, 0.5).
    seed : int, default 0
        Non-negative seed; the output is a deterministic function of all arguments.

    Returns
    -------
    Xs : list of np.ndarray
        Per-task float64 design matrices with ``N(0, I_d)`` rows, each ``(n_t, d)``.
    ys : list of np.ndarray
        Per-task float64 labels in ``{-1, +1}``, each ``(n_t,)``; every task has both labels.

    Raises
    ------
    ValueError
        Naming the argument, if an argument is out of range.
    """
    return synthetic_source(**arguments).draw_all()
