"""Decoupling outlying tasks from MOCHA's task relationships (robust mode), Flower-free.

In MOCHA (and Mb-SGD on MOCHA's primal) every task owns its model, and the tasks are tied only
by the regulariser's matrix: W = B M with M = K^-1, so task s moves task t's model through
the off-diagonal entry M_st. A lying device cannot take another task's model, but through
M_st it can pull every coupled model (and, through the Omega-step, the relationships
themselves). Robust mode therefore *decouples* a task whose updates are outliers against the
federation (:class:`OutlierWatch`): its row and column of M lose their off-diagonal entries,

    M' = M with M'_st = M'_ts = 0 for every decoupled s and t != s,
    M'_ss = the median of the coupled tasks' M_tt,

a principal-submatrix block of a symmetric positive definite matrix and positive diagonal
entries, so M' is symmetric positive definite: the regulariser K' = M'^-1 is block diagonal,
valid, and every duality gap computed with it is a true bound for it. The coupled tasks'
models W_H = B_H M_HH are exactly what they would be if the decoupled tasks' dual images were
0 (their replies lost); a decoupled task keeps training its own model w_s = b_s M'_ss,
regularised like a typical task (its diagonal is the coupled tasks' median; for the fixed
formulations, whose diagonal is constant, that is its own M_ss). The Omega-step of a learned
formulation sees the decoupled tasks' models as 0 (:func:`coupled_models`), so they shape no
relationship either (for ``probabilistic`` and ``clustered`` a zero column makes the step's
Gram matrix, and so Omega, block diagonal; ``graphical``'s lasso too, up to its tolerance,
and M' removes the rest).

Decoupling is sticky for the run: a device caught once (e.g. one that lies only every other
round) stays decoupled; the statistics are re-checked every round and only add tasks.
"""

from __future__ import annotations

import numpy as np

from .robust import log_upper_fence

__all__ = [
    "FENCE_FACTOR",
    "FENCE_MADS",
    "IMAGE_FENCE_FACTOR",
    "IMAGE_PERSISTENCE",
    "IMAGE_RETREAT",
    "OutlierWatch",
    "STEP_SHARE_FLOOR",
    "block_diagonal_regulariser",
    "coupled_models",
    "decoupled_inverse",
    "federation_scale",
    "outlying",
    "project_blocks",
]

#: The share of its step bound an update must use, at least, to be an outlier: late in a run
#: honest steps fall to 1e-8 of their bounds at unequal speeds, so a task still moving at
#: 1e-3 would otherwise stand out; a device pushing at the bound uses all of it.
STEP_SHARE_FLOOR = 0.5

#: A task is an outlier when its statistic exceeds the federation's median by this factor
#: *and* by :data:`FENCE_MADS` scaled MADs on the log scale (:func:`~.robust.log_upper_fence`).
FENCE_FACTOR = 10.0
FENCE_MADS = 5.0

#: The factor of the fence on what a task has accumulated (|b_t|, |w_t| R_t): tighter than
#: :data:`FENCE_FACTOR`, as honest tasks' accumulated images are alike (their largest is
#: within 2 to 4 times their median on ``small``, ``synthetic`` and ``eat-voc``) while a
#: device kept just under the fence pulls the coupled models by that factor times an honest
#: task's pull, round after round.
IMAGE_FENCE_FACTOR = 5.0

#: Updating rounds a task's accumulated image must be an outlier (not retreating) to
#: decouple it.
IMAGE_PERSISTENCE = 3

#: The relative shrinkage of an outlying image in one updating round that counts as moving
#: back toward the others (the round then does not count toward :data:`IMAGE_PERSISTENCE`).
IMAGE_RETREAT = 0.05


def outlying(values: np.ndarray, factor: float = FENCE_FACTOR,
             k: float = FENCE_MADS) -> np.ndarray:
    """Whether each positive entry of ``values`` lies above the federation's log-scale upper
    fence ``exp(median(log v) + max(k MAD(log v), log factor))`` of the positive finite
    entries; non-positive entries are never outliers, non-finite ones always are. With fewer
    than 3 positive finite entries no finite entry is an outlier (no majority to compare with).

    The statistics passed in are scale-free ratios (a reply's size over its own bound), so
    tasks of different data scales are compared fairly; only the upper side is flagged (a task
    that did little work, or dropped, is no threat).
    """
    v = np.asarray(values, dtype=np.float64).ravel()
    finite = np.isfinite(v)
    positive = finite & (v > 0)
    if int(positive.sum()) < 3:
        return ~finite
    fence = log_upper_fence(v[positive], factor=factor, k=k)
    with np.errstate(invalid="ignore"):
        return (v > fence) | ~finite


class OutlierWatch:
    """Which tasks robust mode decouples, decided round by round from two scale-free
    statistics of the tasks' updates, each the share of a bound the task used:

    * ``step / step_bound``: the size of this round's update (|delta-b_t|, or Mb-SGD's mean
      subgradient) over the largest a feasible one could have. Honest SDCA steps mix signs
      and shrink as the task converges; a device pushing one direction at the bound uses all
      of it. An outlier (:func:`outlying`, factor :data:`FENCE_FACTOR`) that also uses
      :data:`STEP_SHARE_FLOOR` of its bound is decoupled at once;
    * ``image / image_bound``: the size of what the task has accumulated (|b_t|, or
      |w_t| R_t) over its scale, against the fence of factor :data:`IMAGE_FENCE_FACTOR`. A
      device that pushes more gently, or stopped moving after driving its b_t far, is caught
      here once it has been an outlier in :data:`IMAGE_PERSISTENCE` rounds in which it
      updated without moving back toward the others (its share shrinking by at least
      :data:`IMAGE_RETREAT`), with no round among the others in between: an honest task that
      joins late (or comes back after drop-outs) takes a large first step from alpha = 0 and
      then returns to the others over a few rounds, its share shrinking every round it works.

    Both bounds should come from :func:`federation_scale`. Tasks with a zero or undefined
    bound (dropped, no R_t) count as 0: no threat, and not part of the federation's median.
    Decoupling is sticky (``decoupled`` only gains tasks).
    """

    def __init__(self, num_tasks: int) -> None:
        self.decoupled = np.zeros(num_tasks, dtype=bool)
        self.streak = np.zeros(num_tasks, dtype=np.int64)
        self.image = np.zeros(num_tasks)  # the shares of the last round

    def update(self, step: np.ndarray, step_bound: np.ndarray, image: np.ndarray,
               image_bound: np.ndarray, updated: np.ndarray) -> np.ndarray:
        """Take the round's statistics (``updated``: bool, the tasks whose update this round
        was applied); decouple the outliers; return the newly decoupled tasks (bool)."""
        used = _share(step, step_bound)
        pushing = outlying(used) & (used >= STEP_SHARE_FLOOR) & updated
        share = _share(image, image_bound)
        far = outlying(share, factor=IMAGE_FENCE_FACTOR)
        holding = updated & (share > (1.0 - IMAGE_RETREAT) * self.image)
        self.streak = np.where(far, self.streak + holding, 0)
        self.image = share
        new = (pushing | (self.streak >= IMAGE_PERSISTENCE)) & ~self.decoupled
        self.decoupled |= new
        return new


def federation_scale(bound: np.ndarray) -> np.ndarray:
    """The scale the statistics of :class:`OutlierWatch` divide by: each task's own bound
    (e.g. R~_t), but at most the federation's median of them, so that a device claiming a
    larger scale than the others' (within what the fences let through) cannot hide a larger
    update behind it; NaN bounds stay NaN."""
    b = np.asarray(bound, dtype=np.float64)
    finite = b[np.isfinite(b)]
    return np.minimum(b, float(np.median(finite))) if finite.size else b


def _share(value: np.ndarray, bound: np.ndarray) -> np.ndarray:
    value = np.asarray(value, dtype=np.float64)
    bound = np.asarray(bound, dtype=np.float64)
    usable = np.isfinite(bound) & (bound > 0)
    return np.divide(value, bound, out=np.zeros_like(value), where=usable)


def decoupled_inverse(M: np.ndarray, decoupled: np.ndarray) -> np.ndarray:
    """M' of the module docstring: ``M`` (m, m, symmetric positive definite) with the
    off-diagonal entries of the ``decoupled`` (bool, (m,)) tasks' rows and columns set to 0
    and their diagonal set to the median of the other tasks' (their own when every task is
    decoupled). ``M`` itself when no task is decoupled."""
    mask = np.asarray(decoupled, dtype=bool)
    if not mask.any():
        return M
    diag = np.diag(M).copy()
    out = np.array(M, dtype=np.float64, copy=True)
    out[mask, :] = 0.0
    out[:, mask] = 0.0
    coupled = diag[~mask]
    diag[mask] = float(np.median(coupled)) if coupled.size else diag[mask]
    out[np.flatnonzero(mask), np.flatnonzero(mask)] = diag[mask]
    return out


def coupled_models(W: np.ndarray, decoupled: np.ndarray | None) -> np.ndarray:
    """The models an Omega-step may learn the relationships from: ``W`` with the decoupled
    tasks' columns set to 0 (``W`` itself when none is)."""
    if decoupled is None or not np.any(decoupled):
        return W
    out = W.copy()
    out[:, np.asarray(decoupled, dtype=bool)] = 0.0
    return out


def block_diagonal_regulariser(K: np.ndarray, decoupled: np.ndarray) -> np.ndarray:
    """K' = M'^-1 (:func:`decoupled_inverse` of M = K^-1) for a primal method: the coupled
    tasks' block is the inverse of M's (the Schur complement of K: the regulariser minimised
    over the decoupled tasks' models), every decoupled task a 1 x 1 block ``1 / M'_ss``."""
    mask = np.asarray(decoupled, dtype=bool)
    if not mask.any():
        return K
    M = np.linalg.inv(0.5 * (K + K.T))
    M = decoupled_inverse(0.5 * (M + M.T), mask)
    out = np.zeros_like(M)
    keep = np.flatnonzero(~mask)
    if keep.size:
        block = np.linalg.inv(M[np.ix_(keep, keep)])
        out[np.ix_(keep, keep)] = 0.5 * (block + block.T)
    idx = np.flatnonzero(mask)
    out[idx, idx] = 1.0 / M[idx, idx]
    return out


def project_blocks(W: np.ndarray, K: np.ndarray, decoupled: np.ndarray) -> np.ndarray:
    """Project the coupled tasks' columns of W onto the Frobenius ball of radius
    ``sqrt(m_H / lambda_min(K_HH))`` and each decoupled task's column onto the ball of radius
    ``sqrt(1 / K_ss)``, for a block-diagonal K (:func:`block_diagonal_regulariser`): each
    block is its own problem, whose optimum lies in its ball
    (:func:`~fmtl_flower.core.baselines.mbsgd_radius`), so a decoupled task's large column no
    longer shrinks the others by a shared projection."""
    mask = np.asarray(decoupled, dtype=bool)
    out = W.copy()
    keep = np.flatnonzero(~mask)
    if keep.size:
        lam_min = float(np.linalg.eigvalsh(K[np.ix_(keep, keep)])[0])
        out[:, keep] = _onto_ball(out[:, keep], np.sqrt(keep.size / lam_min))
    for s in np.flatnonzero(mask).tolist():
        out[:, [s]] = _onto_ball(out[:, [s]], np.sqrt(1.0 / K[s, s]))
    return out


def _onto_ball(W: np.ndarray, radius: float) -> np.ndarray:
    size = float(np.linalg.norm(W))
    return W * (radius / size) if size > radius else W
