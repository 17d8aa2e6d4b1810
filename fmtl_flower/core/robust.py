"""Robust statistics the server uses to distrust what one device says about itself.

A federation of phones and Raspberry Pis contains buggy or compromised devices. Whatever one
of them reports (its data's row norms, its example count, its model update), the server can
only check it against what the *rest* of the federation makes plausible. This module holds
the numerics of those checks, Flower-free:

* fences from the median and the median absolute deviation (MAD) of a quantity across the
  federation's tasks (:func:`upper_fence`, :func:`log_upper_fence`, :func:`outlier_mask`),
  robust against any minority of liars (a breakdown point of 50 %);
* a cap on any single device's share of a weighted average (:func:`cap_shares`);
* Byzantine-robust aggregators of model vectors: norm clipping around a center
  (:func:`clip_to_ball`, with the radius from :func:`robust_radius`), coordinate-wise
  (weighted) trimmed mean and median (:func:`trimmed_mean`, :func:`coordinate_median`; the
  behaviour of Flower's ``FedTrimmedAvg`` and ``FedMedian``), and Krum / multi-Krum
  (:func:`krum_select`; Blanchard et al. 2017, Flower's ``Krum``).

Every function takes plain numpy arrays, never raises on non-finite inputs it is documented
to ignore, and costs at most O(K d log K) for K devices and d coordinates.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "MAD_SCALE",
    "cap_shares",
    "clip_to_ball",
    "coordinate_median",
    "krum_select",
    "log_upper_fence",
    "median_mad",
    "outlier_mask",
    "robust_radius",
    "trimmed_mean",
    "upper_fence",
]

#: Scales the MAD to the standard deviation of a normal distribution (1 / Phi^-1(3/4)).
MAD_SCALE = 1.482602218505602


def median_mad(values: np.ndarray) -> tuple[float, float]:
    """The median and the scaled MAD (``MAD_SCALE * median(|v - median|)``) of the finite
    entries of ``values``; ``(nan, nan)`` when there are none."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    if v.size == 0:
        return math.nan, math.nan
    med = float(np.median(v))
    return med, MAD_SCALE * float(np.median(np.abs(v - med)))


def upper_fence(values: np.ndarray, k: float = 5.0, rel_floor: float = 0.0) -> float:
    """``median + k * max(MAD, rel_floor * |median|)`` of the finite ``values``.

    The largest value the federation makes plausible for a quantity whose honest values are
    roughly alike across devices. ``rel_floor`` keeps the fence above the median when most
    devices report the same number (a MAD of 0). ``inf`` when no value is finite (nothing to
    compare with: the caller's operator limit applies alone).
    """
    med, mad = median_mad(values)
    if math.isnan(med):
        return math.inf
    return med + k * max(mad, rel_floor * abs(med))


def log_upper_fence(values: np.ndarray, factor: float = 10.0, k: float = 5.0) -> float:
    """An upper fence for a positive scale quantity (row norms, example counts) on the log
    scale: ``exp(median(log v) + max(k * MAD(log v), log(factor)))``.

    On the log scale a device's claim is compared with the others' by ratio: it may exceed
    the federation's median by ``factor`` always, and by more only when the honest values
    themselves spread that widely. Non-positive and non-finite values are ignored; ``inf``
    when none is left.
    """
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v) & (v > 0)]
    if v.size == 0:
        return math.inf
    med, mad = median_mad(np.log(v))
    return math.exp(med + max(k * mad, math.log(factor)))


def outlier_mask(values: np.ndarray, k: float = 5.0, rel_floor: float = 0.0) -> np.ndarray:
    """Whether each value lies more than ``k`` scaled MADs (at least ``rel_floor * |median|``)
    from the median of the finite values; non-finite values are outliers. With fewer than 3
    finite values nothing is an outlier (no majority to compare with)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    finite = np.isfinite(v)
    if int(finite.sum()) < 3:
        return ~finite
    med, mad = median_mad(v)
    spread = max(mad, rel_floor * abs(med))
    with np.errstate(invalid="ignore"):
        out = np.abs(v - med) > k * spread if spread > 0 else v != med
    return out | ~finite


def cap_shares(weights: np.ndarray, max_share: float) -> np.ndarray:
    """``weights`` with no entry above ``max_share`` of their sum, mass moved to the others.

    Water-filling: the capped entries are set to ``max_share`` of the (new) total and the
    others keep their proportions, which is the closest such vector in ratio. A cap below
    ``1 / K`` is raised to ``1 / K`` (equal weights: no smaller cap exists). Weights must be
    finite and >= 0; an all-zero vector is returned as it is.
    """
    w = np.asarray(weights, dtype=np.float64).copy()
    if w.size == 0 or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("cap_shares takes finite, non-negative weights")
    total = float(w.sum())
    if total <= 0.0:
        return w
    share = max(float(max_share), 1.0 / w.size)
    if float(w.max()) <= share * total * (1.0 + 1e-12):
        return w / total * total  # nothing binds (as before: normalised and scaled back)
    order = np.argsort(-w, kind="stable")
    desc = w[order]
    free_mass = np.cumsum(desc[::-1])[::-1]  # mass of desc[c:], for c capped entries
    out = np.empty_like(w)
    for c in range(1, w.size):
        if free_mass[c] <= 0.0:  # only the capped entries carry weight: they share it equally
            out[order[:c]] = total / c
            out[order[c:]] = 0.0
            return out
        # the uncapped keep their proportions (ratios first: a subnormal free mass would
        # lose them in a product) and carry 1 - c share of the total
        proportions, free_share = desc[c:] / free_mass[c], 1.0 - c * share
        if proportions[0] * free_share <= share * (1.0 + 1e-12):
            out[order[:c]] = share * total
            out[order[c:]] = free_share * total * proportions
            return out
    out[:] = total / w.size  # share = 1/K: equal weights
    return out


def robust_radius(distances: np.ndarray, factor: float = 3.0) -> float:
    """A clipping radius from the devices' update sizes: ``factor`` times their median
    (finite ones only; ``inf`` when none is finite, 0 when the median is 0)."""
    d = np.asarray(distances, dtype=np.float64).ravel()
    d = d[np.isfinite(d)]
    if d.size == 0:
        return math.inf
    return factor * float(np.median(d))


def clip_to_ball(points: np.ndarray, center: np.ndarray, radius: float) -> np.ndarray:
    """Each row of ``points`` (K, d) moved onto the ball of ``radius`` around ``center`` if
    it lies outside: ``center + (p - center) * min(1, radius / |p - center|)``."""
    p = np.asarray(points, dtype=np.float64)
    delta = p - center
    with np.errstate(over="ignore", invalid="ignore"):
        size = np.linalg.norm(delta, axis=1)
        scale = np.where(size > radius, radius / np.where(size > 0, size, 1.0), 1.0)
    return center + delta * scale[:, None]


def _sorted_with_weights(points: np.ndarray, weights: np.ndarray | None
                         ) -> tuple[np.ndarray, np.ndarray, float]:
    p = np.asarray(points, dtype=np.float64)
    if p.ndim == 1:
        p = p[:, None]
    k = p.shape[0]
    w = np.ones(k) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (k,) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError("weights must be K finite, non-negative numbers with a positive sum")
    order = np.argsort(p, axis=0, kind="stable")
    return (np.take_along_axis(p, order, axis=0), w[order], float(w.sum()))


def trimmed_mean(points: np.ndarray, trim: float = 0.2,
                 weights: np.ndarray | None = None) -> np.ndarray:
    """Coordinate-wise (weighted) trimmed mean of the rows of ``points`` (K, d).

    In every coordinate the values are sorted and a ``trim`` fraction of the total weight is
    cut from each end (a value straddling a cut counts with the part of its weight inside);
    the rest is averaged with its weights. Unweighted with ``K * trim`` an integer, this is
    ``scipy.stats.trim_mean`` and Flower's ``FedTrimmedAvg(beta=trim)``. ``trim`` in
    [0, 0.5); as it tends to 0.5 the result tends to :func:`coordinate_median`.
    """
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim!r}")
    values, w, total = _sorted_with_weights(points, weights)
    upper = np.cumsum(w, axis=0)
    lower = upper - w
    lo, hi = trim * total, (1.0 - trim) * total
    inside = np.clip(np.minimum(upper, hi) - np.maximum(lower, lo), 0.0, None)
    mass = inside.sum(axis=0)
    out = (values * inside).sum(axis=0) / np.where(mass > 0, mass, 1.0)
    return out if np.ndim(points) > 1 else out[0]


def coordinate_median(points: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Coordinate-wise (weighted) median of the rows of ``points`` (K, d): in each
    coordinate, the value at which the sorted values' cumulative weight reaches half the
    total (the mean of the two middle values when it lands exactly between two, so the
    unweighted result equals ``np.median(points, axis=0)``; Flower's ``FedMedian``)."""
    values, w, total = _sorted_with_weights(points, weights)
    upper = np.cumsum(w, axis=0)
    half = 0.5 * total
    tol = 1e-12 * total
    first = np.argmax(upper >= half - tol, axis=0)  # first value reaching half the weight
    cols = np.arange(values.shape[1])
    low = values[first, cols]
    exact = np.abs(upper[first, cols] - half) <= tol
    nxt = np.minimum(first + 1, values.shape[0] - 1)
    out = np.where(exact & (first + 1 < values.shape[0]), 0.5 * (low + values[nxt, cols]), low)
    return out if np.ndim(points) > 1 else out[0]


def krum_select(points: np.ndarray, num_malicious: int, num_selected: int = 1) -> np.ndarray:
    """Indices of the rows chosen by (multi-)Krum: each row's score is the sum of its squared
    distances to its ``K - num_malicious - 2`` nearest other rows; the ``num_selected``
    lowest scores win (ties by index). Needs ``K > 2 * num_malicious + 2``; with fewer rows
    the closest to all others by that count (at least 1 neighbour) is used."""
    p = np.asarray(points, dtype=np.float64)
    k = p.shape[0]
    if not 1 <= num_selected <= k:
        raise ValueError(f"num_selected must be in 1..{k}, got {num_selected}")
    sq = np.einsum("ij,ij->i", p, p)
    with np.errstate(over="ignore", invalid="ignore"):
        dist = np.maximum(sq[:, None] + sq[None, :] - 2.0 * p @ p.T, 0.0)
    np.fill_diagonal(dist, np.inf)
    neighbours = max(1, min(k - 1, k - int(num_malicious) - 2))
    nearest = np.sort(dist, axis=1)[:, :neighbours]
    scores = nearest.sum(axis=1)
    scores = np.where(np.isfinite(scores), scores, np.inf)
    return np.argsort(scores, kind="stable")[:num_selected]
