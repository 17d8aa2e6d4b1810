"""Record-level differential privacy for OFMTL (Flower-free): what each device releases, its
sensitivity to one record, and how many releases a run can cost a device.

What is protected: one training record (x_i, y_i) of one device, under replacement adjacency
(n public), as for MOCHA's record-level DP (:mod:`fmtl_flower.core.record_dp`, whose
functions this module reuses). Each device trains on its rows clipped to norm C
(:func:`~fmtl_flower.core.record_dp.clip_rows`).

What an OFMTL device releases, phase by phase:

1. **MOCHA (the founding devices' training, and every full retraining)**: each round's
   ``delta-b``, with MOCHA's record-level DP unchanged (separable step, noise
   z * Delta, :mod:`fmtl_flower.core.record_dp`). One release per round with work.
2. **A newcomer's O(1) exchange** (``outer`` round trips per attempt): the server sends
   (omega, c); the newcomer replies its model w. Without DP, w comes out of ``inner`` rounds
   of *sequential* SDCA on the device: one record moves every later coordinate step, so w's
   sensitivity to it is of the order of w itself. Under DP each round trip is instead **one
   separable round** (``inner`` is not used) of ``steps = min(floor(newcomer_frac n), n)``
   coordinate steps, all taken at the *public* model

       w_pub = (b~ - lam c) / (lam omega),      b~ = b + e                        (**)

   (b = X^T alpha / n the device's true image, e the sum of the noises it released so far:
   b~ is the server's, a function of the earlier releases; :func:`public_model`) with
   MOCHA's step curvature for this single-task problem, m_tt sigma' = 1 / (lam omega),
   times ``steps`` (:func:`newcomer_curvature`, the separable lower bound of
   :func:`~fmtl_flower.core.record_dp.separable_m_tt`). Record i's dual history then
   depends on record i and on public numbers only, and replacing it moves
   ``delta-b = X^T d_alpha / n`` by at most

       Delta = 2 c_i / n,   c_i = record_contribution(C, n, 1, steps / (lam omega), |w_pub|)

   (:func:`newcomer_sensitivity`). The device adds N(0, (z Delta)^2 I_d) to delta-b and
   replies ``w = (b~_new - lam c) / (lam omega)``, b~_new = b~ + delta-b + noise: a
   function of the releases (post-processing), so the wire contract is unchanged and the
   server recovers b~_new = lam omega w + lam c. One release per round trip, counted when
   the server sends it (a lost reply counts; a failed attempt's round trips count).
3. **Evaluation**: each device's test errors (held-out rows, outside the guarantee, as for
   MOCHA).

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

from .baselines import mbsdca_local_update
from .record_dp import noisy_release, record_contribution, release_sensitivity
from .rng import TAG_RECORD_DP, coordinate_order

__all__ = [
    "PrivateNewcomerStep",
    "newcomer_curvature",
    "newcomer_noise_rng",
    "newcomer_order",
    "newcomer_sensitivity",
    "newcomer_steps",
    "private_newcomer_step",
    "public_model",
    "release_budget",
    "retraining_sizes",
]

#: The newcomer stream's last key word (after MOCHA's tag): keeps it apart from MOCHA's.
NEWCOMER_STREAM = 1


def public_model(b_noisy: np.ndarray, c: np.ndarray, lam: float, omega: float) -> np.ndarray:
    """(**): the newcomer's model as the server knows it, ``(b~ - lam c) / (lam omega)``."""
    return (np.asarray(b_noisy, dtype=np.float64) - lam * np.asarray(c)) / (lam * omega)


def newcomer_steps(newcomer_frac: float, n: int) -> int:
    """Coordinate steps of one private newcomer round: ``min(floor(newcomer_frac n), n)``."""
    if not (newcomer_frac > 0 and math.isfinite(newcomer_frac)):
        raise ValueError(f"newcomer_frac must be a finite number > 0, got {newcomer_frac!r}")
    return min(int(math.floor(newcomer_frac * int(n))), int(n))


def newcomer_curvature(lam: float, omega: float, steps: int) -> float:
    """m_tt of the newcomer's separable step: ``steps / (lam omega)`` (MOCHA's single-task
    m_tt sigma' = 1 / (lam omega) times the coordinates updated together)."""
    lam_omega = float(lam) * float(omega)
    if not (lam_omega > 0 and math.isfinite(lam_omega)):
        raise ValueError(f"lam * omega must be finite and > 0, got {lam_omega!r}")
    return max(int(steps), 1) / lam_omega


def newcomer_sensitivity(clip: float, n: int, lam: float, omega: float, steps: int,
                         w_norm: float | None = None) -> float:
    """Delta, the largest L2 change of one newcomer release ``X^T d_alpha / n`` when one
    record is replaced: ``2 c / n`` with c the step-bounded contribution at ``|w_pub|``
    (:func:`~fmtl_flower.core.record_dp.record_contribution`), or the box's ``C`` when
    ``w_norm`` is None (an upper bound for any w)."""
    contribution = None if w_norm is None else record_contribution(
        clip, n, 1.0, newcomer_curvature(lam, omega, steps), float(w_norm), "hinge")
    return release_sensitivity(clip, n, 1.0, 1.0, contribution)


def newcomer_noise_rng(noise_seed: int | None, task_id: int, step: int
                       ) -> np.random.Generator:
    """The newcomer's noise Generator for step ``step`` (module docstring)."""
    if noise_seed is None:
        return np.random.default_rng(secrets.randbits(128))
    return np.random.default_rng([int(noise_seed), int(task_id), int(step), TAG_RECORD_DP,
                                  NEWCOMER_STREAM])


@dataclass(frozen=True)
class PrivateNewcomerStep:
    """One private newcomer round (:func:`private_newcomer_step`).

    Attributes
    ----------
    alpha : ndarray (n,)
        The device's new true dual variables (kept on the device).
    noise : ndarray (d,)
        e, the sum of every noise it has released (kept on the device).
    w : ndarray (d,)
        The reply: ``public_model(b + noise, c, lam, omega)`` with the new alpha.
    w_own : ndarray (d,)
        The device's model without its own noise, ``(b - lam c) / (lam omega)`` (what it
        evaluates; post-processing on the device).
    std : float
        The noise's standard deviation z * Delta on delta-b.
    """

    alpha: np.ndarray
    noise: np.ndarray
    w: np.ndarray
    w_own: np.ndarray
    std: float


def private_newcomer_step(X: np.ndarray, y: np.ndarray, alpha: np.ndarray, noise: np.ndarray,
                          *, omega: float, c: np.ndarray, lam: float, steps: int,
                          order: np.ndarray, clip: float, noise_multiplier: float,
                          rng: np.random.Generator, sqnorm: np.ndarray | None = None
                          ) -> PrivateNewcomerStep:
    """One round trip of the newcomer under record-level DP (module docstring, phase 2).

    Parameters
    ----------
    X, y : the newcomer's rows **clipped to norm** ``clip`` (n, d), labels in {-1, +1}.
    alpha, noise : its dual variables (n,) and released noise so far (d,).
    omega, c, lam : the server's message (omega > 0, c (d,)) and lambda.
    steps : coordinates updated (``order[:steps]``), 0 .. n.
    order : a permutation of 0 .. n - 1.
    clip : C (rows' norm bound).
    noise_multiplier : z >= 0 (0: no noise, the release is delta-b itself).
    rng : the noise stream (:func:`newcomer_noise_rng`).

    Returns
    -------
    PrivateNewcomerStep
    """
    n = X.shape[0]
    b = X.T @ alpha / n
    w_pub = public_model(b + noise, c, lam, omega)
    d_alpha, d_b = mbsdca_local_update(X, y, alpha, w_pub,
                                       m_tt=newcomer_curvature(lam, omega, steps),
                                       budget=steps, order=order, sqnorm=sqnorm, loss="hinge")
    sensitivity = newcomer_sensitivity(clip, n, lam, omega, steps, float(np.linalg.norm(w_pub)))
    released = noisy_release(d_b, sensitivity, noise_multiplier, rng) if steps else d_b
    new_alpha = y * np.clip(y * (alpha + d_alpha), 0.0, 1.0)
    new_noise = noise + (released - d_b)
    b_new = X.T @ new_alpha / n
    return PrivateNewcomerStep(alpha=new_alpha, noise=new_noise,
                               w=public_model(b_new + new_noise, c, lam, omega),
                               w_own=public_model(b_new, c, lam, omega),
                               std=float(noise_multiplier) * sensitivity if steps else 0.0)


def newcomer_order(seed: int, task_id: int, step: int, n: int) -> np.ndarray:
    """The coordinate order of private step ``step`` (round ``step + 1`` of the task's
    :func:`~fmtl_flower.core.rng.coordinate_order` stream, as the non-private first round)."""
    return coordinate_order(seed, task_id, step + 1, n)


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
