"""Systems heterogeneity: per-round local budgets and simulated drop-outs (seeded).

Budgets are numbers of SDCA coordinate steps per node and round.

* ``sys-het=none``: H_t = floor(local_frac * n_t) (statistical heterogeneity only).
* ``sys-het=low`` / ``high`` with ``sys-het-base=n_min`` (MOCHA appendix E.3): H_t drawn
  uniformly from [0.9 n_min, n_min] / [0.1 n_min, n_min], n_min the smallest training set.
* ``sys-het-base=n_t`` (the reference code's variant): H_t = floor(f_t * n_t) with f_t drawn
  from U(0.9, 1) / U(0.1, 1), a fraction of the node's own n_t.

Drop-outs (MOCHA Assumption 2, theta = 1): with probability ``drop_prob`` a node does no local
work in a round. Every draw comes from a Generator seeded by (seed, round), so runs repeat.
"""

from __future__ import annotations

import numpy as np

from ..core.rng import TAG_BUDGET, TAG_DROP, round_rng

SYS_HET_LEVELS = {"none": None, "low": 0.9, "high": 0.1}
SYS_HET_BASES = ("n_min", "n_t")

def local_budgets(
    n_train: np.ndarray,
    *,
    local_frac: float = 1.0,
    sys_het: str = "none",
    base: str = "n_min",
    seed: int = 0,
    server_round: int = 1,
) -> np.ndarray:
    """Coordinate-step budget of every task for one round.

    Parameters
    ----------
    n_train : ndarray of shape (m,)
        Training-set sizes n_t.
    local_frac : float
        Fraction of n_t per round when ``sys_het == "none"`` (> 0).
    sys_het : {"none", "low", "high"}
    base : {"n_min", "n_t"}
    seed, server_round : int
        The draw is a function of (seed, round) only.

    Returns
    -------
    ndarray of shape (m,), int64, every entry >= 1
    """
    n_train = np.asarray(n_train, dtype=np.int64)
    if sys_het not in SYS_HET_LEVELS:
        raise ValueError(f"sys-het must be one of {list(SYS_HET_LEVELS)}, got {sys_het!r}")
    if base not in SYS_HET_BASES:
        raise ValueError(f"sys-het-base must be one of {list(SYS_HET_BASES)}, got {base!r}")
    if not local_frac > 0:
        raise ValueError(f"local-frac must be > 0, got {local_frac}")
    low = SYS_HET_LEVELS[sys_het]
    if low is None:
        budgets = np.floor(local_frac * n_train)
    else:
        rng = round_rng(seed, server_round, TAG_BUDGET)
        if base == "n_min":
            n_min = float(n_train.min())
            budgets = np.floor(rng.uniform(low * n_min, n_min, size=n_train.shape))
        else:
            budgets = np.floor(rng.uniform(low, 1.0, size=n_train.shape) * n_train)
    return np.maximum(budgets, 1).astype(np.int64)


def check_drop_prob(drop_prob: float | np.ndarray, num_tasks: int | None = None) -> np.ndarray:
    """Validate one drop-out probability, or one per task (p_t, MOCHA's p_t^h), in [0, 1].

    A per-task 1.0 is a device that never sends; a single probability must be below 1.
    Returns an array (shape () or (num_tasks,)).
    """
    p = np.asarray(drop_prob, dtype=np.float64)
    if p.ndim == 0:
        if not 0.0 <= float(p) < 1.0:
            raise ValueError(f"drop-prob must be in [0, 1), got {drop_prob}")
        return p
    if p.ndim != 1 or (num_tasks is not None and p.shape[0] != num_tasks):
        raise ValueError(f"per-task drop probabilities must have shape ({num_tasks},), "
                         f"got {p.shape}")
    if not np.all((p >= 0.0) & (p <= 1.0)):
        raise ValueError("per-task drop probabilities must lie in [0, 1]")
    return p


def drop_mask(num_tasks: int, drop_prob: float | np.ndarray, *, seed: int,
              server_round: int) -> np.ndarray:
    """Boolean mask of the tasks that drop out (do no local work) in this round.

    ``drop_prob`` is one probability for every task or one per task (p_t).
    """
    p = check_drop_prob(drop_prob, num_tasks)
    if not np.any(p):
        return np.zeros(num_tasks, dtype=bool)
    return round_rng(seed, server_round, TAG_DROP).random(num_tasks) < p
