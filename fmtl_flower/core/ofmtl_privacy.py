"""Record-level differential privacy for OFMTL (Flower-free): what each device releases, its
sensitivity to one record, and how many releases a run can cost a device.

What is protected: one training record (x_i, y_i) of one device, under replacement adjacency
(n public), as for MOCHA's record-level DP (:mod:`fmtl_flower.core.record_dp`, whose
functions this module reuses). Each device trains on its rows clipped to norm C
(:func:`~fmtl_flower.core.record_dp.clip_rows`).

What an OFMTL device releases, phase by phase:

1. **MOCHA (the founding devices' training, and every full retraining)**: each round's
   ``delta-b``, with MOCHA's record-level DP unchanged (separable step, noise z * Delta,
   :mod:`fmtl_flower.core.record_dp`). One release per round with work.
2. **A newcomer's O(1) exchange** (``outer`` round trips per attempt): the server sends
   (omega, c); the newcomer replies its model w. Its subproblem (:mod:`fmtl_flower.core.
   ofmtl`, (*))

       P_new(w) = (1/n) sum_i hinge(y_i x_i . w) + (lam omega / 2) |w|^2 + lam c . w

   is (lam omega)-strongly convex and its loss C-Lipschitz in w (|x_i| <= C; the hinge is
   1-Lipschitz in the margin, which is why OFMTL's record-level DP takes the hinge only,
   :func:`fmtl_flower.strategies.ofmtl_privacy.enable_ofmtl_record_dp`), so its
   minimiser w* moves by at most 2 C / (n lam omega) when one record is replaced (the
   output-perturbation bound of Chaudhuri et al. 2011: the two objectives differ by a
   (2 C / n)-Lipschitz function; the linear term lam c . w is the same for both). The
   device runs the same sequential SDCA as without DP (``inner`` rounds,
   :func:`~fmtl_flower.core.ofmtl.newcomer_fit`), then more rounds until the subproblem's
   duality gap is at most G = eta^2 C^2 / (2 n^2 lam omega) (:func:`gap_target`), which puts
   its w within sqrt(2 G / (lam omega)) = eta C / (n lam omega) of w*. So one record moves
   the w it computes by at most

       Delta = 2 (1 + eta) C / (n lam omega)         (:func:`newcomer_sensitivity`)

   whatever its coordinate orders and warm start, and it replies w + N(0, (z Delta)^2 I_d)
   (:func:`private_newcomer_fit`). One release per round trip, counted when the server sends
   it (a lost reply counts; a failed attempt's round trips count). The noise is fresh at
   every release, never accumulated: the device's own model is its w, untouched by it.
3. **Evaluation**: each device's test errors (held-out rows, outside the guarantee, as for
   MOCHA).

At z = 0 nothing is claimed (epsilon is inf) and the device stops after its ``inner``
rounds, as without DP: with a clip that never binds the newcomer's exchange is then the one
without DP, bit for bit.

Accounting: every release of a run has the same noise multiplier z, so device t's epsilon
is that of its count k_t of Gaussian mechanisms adaptively composed
(:class:`~fmtl_flower.core.record_dp.RecordAccountant`, dp-accounting's RDP accountant,
MOCHA's). A target epsilon fixes z once from the most releases any device can make over
the run (:func:`release_budget`).

The noise stream of a newcomer's step (:func:`newcomer_noise_rng`) is the operating
system's entropy, or with a device-held ``noise_seed`` (tests, reproducible experiments)
``[noise_seed, task, step, TAG_RECORD_DP, 1]``: a key of five words, distinct from
MOCHA's four-word ``[noise_seed, task, round, TAG_RECORD_DP]`` of the same device.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np

from .ofmtl import newcomer_duality_gap, newcomer_fit
from .privacy import check_noise_multiplier
from .record_dp import check_clip
from .rng import TAG_RECORD_DP

__all__ = [
    "GAP_SLACK",
    "MAX_EXTRA_ROUNDS",
    "PrivateNewcomerFit",
    "gap_target",
    "newcomer_noise_rng",
    "newcomer_sensitivity",
    "private_newcomer_fit",
    "release_budget",
    "retraining_sizes",
]

#: The newcomer stream's last key word (after MOCHA's tag): keeps it apart from MOCHA's.
NEWCOMER_STREAM = 1
#: eta: how far from the subproblem's minimiser the released w may be, as a fraction of
#: C / (n lam omega) (the sensitivity grows by the factor 1 + eta).
GAP_SLACK = 0.1
#: SDCA rounds a newcomer may add after its ``inner`` ones to reach the gap target.
MAX_EXTRA_ROUNDS = 2000


def _strong_convexity(lam: float, omega: float) -> float:
    lam_omega = float(lam) * float(omega)
    if not (lam_omega > 0 and math.isfinite(lam_omega)):
        raise ValueError(f"lam * omega must be finite and > 0, got {lam_omega!r}")
    return lam_omega


def newcomer_sensitivity(clip: float, n: int, lam: float, omega: float,
                         slack: float = GAP_SLACK) -> float:
    """Delta = 2 (1 + slack) C / (n lam omega): the largest L2 change of the newcomer's w
    (within its gap target of the minimiser) when one record is replaced."""
    if isinstance(n, bool) or int(n) < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    if not (slack >= 0 and math.isfinite(slack)):
        raise ValueError(f"slack must be finite and >= 0, got {slack!r}")
    return 2.0 * (1.0 + slack) * check_clip(clip) / (int(n) * _strong_convexity(lam, omega))


def gap_target(clip: float, n: int, lam: float, omega: float,
               slack: float = GAP_SLACK) -> float:
    """G = slack^2 C^2 / (2 n^2 lam omega): a duality gap at most G puts w within
    sqrt(2 G / (lam omega)) = slack C / (n lam omega) of the minimiser."""
    return (slack * check_clip(clip)) ** 2 / (2.0 * int(n) ** 2 * _strong_convexity(lam, omega))


def newcomer_noise_rng(noise_seed: int | None, task_id: int, step: int
                       ) -> np.random.Generator:
    """The newcomer's noise Generator for step ``step`` (module docstring)."""
    if noise_seed is None:
        return np.random.default_rng(secrets.randbits(128))
    return np.random.default_rng([int(noise_seed), int(task_id), int(step), TAG_RECORD_DP,
                                  NEWCOMER_STREAM])


@dataclass(frozen=True)
class PrivateNewcomerFit:
    """One private newcomer step (:func:`private_newcomer_fit`).

    Attributes
    ----------
    alpha : ndarray (n,)
        The device's dual variables (kept on the device).
    w : ndarray (d,)
        Its model, the subproblem's (near) minimiser (kept: what it evaluates).
    released : ndarray (d,)
        The reply: ``w + N(0, std^2 I)``.
    std : float
        z * Delta.
    rounds : int
        SDCA rounds run (``inner`` plus those the gap target needed).
    """

    alpha: np.ndarray
    w: np.ndarray
    released: np.ndarray
    std: float
    rounds: int


def private_newcomer_fit(X: np.ndarray, y: np.ndarray, *, omega: float, c: np.ndarray,
                         lam: float, rounds: int, local_frac: float, seed: int, task_id: int,
                         alpha: np.ndarray | None, first_round: int, clip: float,
                         noise_multiplier: float, rng: np.random.Generator,
                         slack: float = GAP_SLACK) -> PrivateNewcomerFit:
    """One newcomer step under record-level DP (module docstring, phase 2).

    Parameters
    ----------
    X, y : the newcomer's rows **clipped to norm** ``clip`` (n, d), labels in {-1, +1}.
    omega, c, lam, rounds, local_frac, seed, task_id, alpha, first_round :
        As for :func:`~fmtl_flower.core.ofmtl.newcomer_fit` (``rounds``: ``inner``).
    clip : C.
    noise_multiplier : z >= 0 (0: no gap target, no noise: the step without DP).
    rng : the noise stream (:func:`newcomer_noise_rng`).
    slack : eta (:data:`GAP_SLACK`).

    Raises
    ------
    ValueError
        When the gap target is not reached within :data:`MAX_EXTRA_ROUNDS` more rounds
        (the device then releases nothing).
    """
    z = check_noise_multiplier(noise_multiplier, "dp-noise-multiplier")
    if z > 0 and int(np.floor(local_frac * X.shape[0])) < 1:
        raise ValueError(f"local-frac {local_frac} gives no SDCA step on {X.shape[0]} rows: "
                         "the gap target cannot be reached")
    kw = {"omega": omega, "c": c, "lam": lam}
    fit = newcomer_fit(X, y, **kw, rounds=rounds, local_frac=local_frac, seed=seed,
                       task_id=task_id, alpha=alpha, first_round=first_round, track_gap=False)
    done = rounds
    if z == 0.0:
        return PrivateNewcomerFit(fit.alpha, fit.w, fit.w, 0.0, done)
    n = X.shape[0]
    target = gap_target(clip, n, lam, omega, slack)
    while newcomer_duality_gap(X, y, fit.alpha, **kw) > target:
        if done - rounds >= MAX_EXTRA_ROUNDS:
            raise ValueError(f"the newcomer's duality gap did not reach {target:.3g} in "
                             f"{MAX_EXTRA_ROUNDS} extra SDCA rounds: nothing released")
        fit = newcomer_fit(X, y, **kw, rounds=1, local_frac=local_frac, seed=seed,
                           task_id=task_id, alpha=fit.alpha, first_round=first_round + done,
                           track_gap=False)
        done += 1
    std = z * newcomer_sensitivity(clip, n, lam, omega, slack)
    return PrivateNewcomerFit(fit.alpha, fit.w, fit.w + rng.normal(0.0, std, size=fit.w.shape),
                              std, done)


def retraining_sizes(initial_tasks: int, num_tasks: int, retrain_ratio: float) -> list[int]:
    """The task counts m at which OFMTL trains MOCHA when every newcomer is admitted: the
    initial training, then each retraining (newcomers since the last training reach
    ``retrain_ratio`` times its tasks)."""
    sizes, m = [int(initial_tasks)], int(initial_tasks)
    while m < num_tasks:
        m += 1
        if m - sizes[-1] >= retrain_ratio * sizes[-1]:
            sizes.append(m)
    return sizes


def release_budget(initial_tasks: int, num_tasks: int, retrain_ratio: float,
                   mocha_rounds: int, outer: int, max_attempts: int) -> int:
    """The most releases one device makes in an OFMTL run that admits every newcomer
    (:func:`retraining_sizes`): a founding device releases once per MOCHA round of every
    training; newcomer m ``outer`` times per attempt (at most ``max_attempts``) plus once
    per MOCHA round of every retraining at or after its arrival."""
    sizes = retraining_sizes(initial_tasks, num_tasks, retrain_ratio)
    most = len(sizes) * int(mocha_rounds)
    for task in range(int(initial_tasks), int(num_tasks)):
        trainings = sum(1 for m in sizes if m > task)
        most = max(most, int(outer) * int(max_attempts) + trainings * int(mocha_rounds))
    return most
