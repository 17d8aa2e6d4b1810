"""FedEM's numerics (Marfoq et al. 2021): E-step, mixture weights, local update, aggregation.

Every client's data is a mixture of M shared components. With component models theta_m and
the client's mixture weights pi (a point of the simplex),

* **E-step** (eq. 8): responsibilities q[m, i] = pi_m p_m(y_i | x_i) / sum_m' (...), computed
  in log space, ``softmax_m(log pi_m - loss[m, i])``, in float64, so that no loss, however
  large, gives NaN or a 0/0;
* **pi update** (eq. 9): pi_m = mean_i q[m, i], then floored at ``PI_FLOOR`` and renormalised,
  so that a component never dies at exactly 0 (log 0 would make it unrecoverable);
* **local solver** (eq. 10, approximately): per component, epochs of mini-batch SGD on
  (1/|batch|) sum_i q[m, i] loss_m(i) (:func:`fmtl_flower.core.local_sgd.sgd_epochs`), each
  component with its own momentum buffer;
* **aggregation**: theta_m <- theta_m + sum_k w[k, m] (theta_{m,k} - theta_m) / Z_m, with
  Z_m the total weight of all training clients (the authors' rule: a client that was not
  sampled counts as holding theta_m) or of the replying clients only (unbiased under partial
  participation);
* **robust aggregation** (:func:`robust_aggregate_components`, the server's robust mode): each
  component's updates clipped around their median to a radius from the honest spread, then
  a coordinate-wise weighted trimmed mean or median (Flower's ``FedTrimmedAvg`` /
  ``FedMedian``) with every device's share of the weight capped, so one device cannot steer
  a shared component;
* **prediction**: the pi-weighted mixture of the components' class probabilities (eq. 6).

The model is any :class:`fmtl_flower.core.backend.ModelBackend` (the numpy models of
:mod:`fmtl_flower.core.models`, or a torch module through
:class:`fmtl_flower.core.torch_backend.TorchBackend`); components are its flat float64
parameter vectors, stacked (M, P).

The same machinery runs the baselines: FedAvg / FedProx / FedAvg+ are M = 1 (q = 1), and
clustered FL (IFCA) trains, per client, only the component of lowest training loss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .backend import ModelBackend
from .local_sgd import SGDConfig
from .robust import cap_shares, clip_to_ball, coordinate_median, trimmed_mean
from .special import logsumexp  # numpy: a device needs no scipy

__all__ = [
    "AGGREGATIONS", "LR_SCHEDULES", "PI_FLOOR", "ROBUST_AGGREGATORS", "LocalUpdate",
    "aggregate_components", "clip_around_median", "robust_aggregate_components",
    "trimmed_device_count", "trimmed_mean_of_devices",
    "check_simplex", "component_losses", "e_step", "fit_mixture_weights", "learning_rate",
    "local_update", "mixture_log_likelihood", "mixture_proba", "sample_clients", "update_pi",
]

#: Smallest mixture weight a component keeps after a pi update.
PI_FLOOR = 1e-6
AGGREGATIONS = ("all", "sampled")
#: How robust mode combines a component's clipped updates (:func:`robust_aggregate_components`).
ROBUST_AGGREGATORS = ("trimmed-mean", "median", "mean")
#: Robust mode's clipping radius: this times the median distance of the round's updates to
#: their median (:func:`clip_around_median`).
CLIP_FACTOR = 2.0
LR_SCHEDULES = ("constant", "multi-step")


def check_simplex(pi: np.ndarray, num_components: int | None = None,
                  atol: float = 1e-6) -> np.ndarray:
    """``pi`` as float64 after checking it is a point of the simplex (ValueError if not)."""
    pi = np.asarray(pi, dtype=np.float64)
    if pi.ndim != 1 or pi.size < 1:
        raise ValueError(f"pi must be a non-empty 1-D array, got shape {pi.shape}")
    if num_components is not None and pi.size != num_components:
        raise ValueError(f"pi has {pi.size} entries, expected {num_components}")
    if not np.all(np.isfinite(pi)):
        raise ValueError("pi has non-finite entries")
    if np.any(pi < 0) or abs(float(pi.sum()) - 1.0) > atol:
        raise ValueError(f"pi is not on the simplex (min {pi.min():.3g}, sum {pi.sum():.9g})")
    return pi


def e_step(pi: np.ndarray, losses: np.ndarray) -> np.ndarray:
    """Responsibilities ``q`` (M, n): q[m, i] proportional to pi_m exp(-losses[m, i]).

    Parameters
    ----------
    pi : ndarray of shape (M,)
        Mixture weights (a point of the simplex; zeros allowed).
    losses : ndarray of shape (M, n)
        Per-sample negative log-likelihoods of each component (finite or +inf).

    Returns
    -------
    ndarray of shape (M, n), float64
        Columns on the simplex. A sample that every component with pi_m > 0 gives infinite
        loss gets the prior pi as its column (no NaN).
    """
    pi = np.asarray(pi, dtype=np.float64)
    losses = np.asarray(losses, dtype=np.float64)
    if losses.ndim != 2 or losses.shape[0] != pi.size:
        raise ValueError(f"losses must have shape ({pi.size}, n), got {losses.shape}")
    if np.any(np.isnan(losses)):
        raise ValueError("losses contain NaN")
    with np.errstate(divide="ignore"):
        log_pi = np.log(pi)[:, None]
    scores = log_pi - losses
    top = scores.max(axis=0, keepdims=True)
    dead = ~np.isfinite(top[0])
    if np.any(dead):  # every component impossible for these samples: fall back on the prior
        scores[:, dead] = np.broadcast_to(log_pi, (pi.size, int(dead.sum())))
        top[:, dead] = scores[:, dead].max(axis=0)
    q = np.exp(scores - top)
    q /= q.sum(axis=0, keepdims=True)
    return q


def update_pi(q: np.ndarray, floor: float = PI_FLOOR) -> np.ndarray:
    """pi_m = mean_i q[m, i] (eq. 9), floored at ``floor`` and renormalised."""
    q = np.asarray(q, dtype=np.float64)
    if q.ndim != 2 or q.shape[1] < 1:
        raise ValueError(f"q must have shape (M, n) with n >= 1, got {q.shape}")
    if not 0 <= floor < 1.0 / q.shape[0]:
        raise ValueError(f"floor must be in [0, 1/M), got {floor}")
    pi = np.maximum(q.mean(axis=1), floor)
    return pi / pi.sum()


def component_losses(model: ModelBackend, components: np.ndarray, X: np.ndarray,
                     y: np.ndarray) -> np.ndarray:
    """Per-sample losses (M, n) of every component on (X, y)."""
    return np.stack([model.per_sample_loss(theta, X, y) for theta in components])


def mixture_log_likelihood(pi: np.ndarray, losses: np.ndarray) -> np.ndarray:
    """log p(y_i | x_i) = logsumexp_m(log pi_m - losses[m, i]), shape (n,)."""
    with np.errstate(divide="ignore"):
        return logsumexp(np.log(np.asarray(pi, dtype=np.float64))[:, None] - losses, axis=0)


def mixture_proba(model: ModelBackend, components: np.ndarray, pi: np.ndarray,
                  X: np.ndarray) -> np.ndarray:
    """Class probabilities (n, C) of the pi-weighted mixture of the components (eq. 6)."""
    out = None
    for theta, weight in zip(components, pi, strict=True):
        if weight > 0:
            part = weight * model.predict_proba(theta, X)
            out = part if out is None else out + part
    if out is None:
        raise ValueError("pi has no positive weight")
    return out


def fit_mixture_weights(losses: np.ndarray, pi0: np.ndarray | None = None, *,
                        max_iter: int = 1000, tol: float = 1e-10,
                        floor: float = PI_FLOOR) -> tuple[np.ndarray, int]:
    """EM over pi alone, the components fixed, to convergence (unseen clients).

    The log-likelihood is concave in pi and each EM step increases it; iteration stops when
    pi moves less than ``tol`` (max-norm) or after ``max_iter`` steps.

    Returns
    -------
    pi : ndarray of shape (M,)
    iterations : int
    """
    M = losses.shape[0]
    pi = np.full(M, 1.0 / M) if pi0 is None else check_simplex(pi0, M).copy()
    for it in range(1, max_iter + 1):
        new = update_pi(e_step(pi, losses), floor)
        if np.max(np.abs(new - pi)) < tol:
            return new, it
        pi = new
    return pi, max_iter


@dataclass(frozen=True)
class LocalUpdate:
    """What one client's round produces.

    Attributes
    ----------
    components : ndarray (M, P)
        The locally updated components (untouched ones equal to those received).
    momentum : ndarray (M, P)
        The optimiser state after the round.
    pi : ndarray (M,)
        The mixture weights after the E-step and pi update (one-hot for clustered FL).
    weights : ndarray (M,)
        Aggregation weight of each component: n_k for every trained component, 0 otherwise.
    train_loss : float
        Mean negative log-likelihood of the mixture (received components, new pi) over the
        client's training set: the client's term of FedEM's objective f(Theta, Pi).
    estep_s, train_s : float
        Seconds spent in the E-step (losses, responsibilities, pi) and in local SGD.
    """

    components: np.ndarray
    momentum: np.ndarray
    pi: np.ndarray
    weights: np.ndarray
    train_loss: float
    estep_s: float = 0.0
    train_s: float = 0.0


def local_update(model: ModelBackend, components: np.ndarray, pi: np.ndarray, momentum: np.ndarray,
                 X: np.ndarray, y: np.ndarray, config: SGDConfig, rng: np.random.Generator,
                 *, mode: str = "mixture", pi_floor: float = PI_FLOOR) -> LocalUpdate:
    """One client's round: E-step, pi update, then weighted local SGD on every component.

    Parameters
    ----------
    model : ModelBackend
    components : ndarray of shape (M, P)
        The components received from the server.
    pi : ndarray of shape (M,)
        The client's mixture weights before the round.
    momentum : ndarray of shape (M, P)
        The client's momentum buffers (zeros: fresh).
    X, y : ndarrays
        The client's training set.
    config : SGDConfig
        Local solver settings (``prox_mu`` > 0 adds FedProx's proximal term around the
        received components).
    rng : numpy Generator
        Mini-batch order (drawn per component, in component order).
    mode : {"mixture", "cluster"}
        ``mixture``: FedEM (M = 1 gives FedAvg); ``cluster``: clustered FL (IFCA), the client
        picks the component of lowest mean training loss and trains only that one.
    """
    started = time.perf_counter()
    M = components.shape[0]
    losses = component_losses(model, components, X, y)
    n = losses.shape[1]
    if mode == "mixture":
        q = e_step(pi, losses)
        new_pi = update_pi(q, pi_floor) if M > 1 else np.ones(1)
        chosen = range(M)
    elif mode == "cluster":
        best = int(np.argmin(losses.mean(axis=1)))
        q = np.zeros((M, n))
        q[best] = 1.0
        new_pi = np.zeros(M)
        new_pi[best] = 1.0
        chosen = [best]
    else:
        raise ValueError(f"mode must be 'mixture' or 'cluster', got {mode!r}")
    train_loss = float(-mixture_log_likelihood(new_pi, losses).mean())
    estep_s = time.perf_counter() - started
    out = np.array(components, dtype=np.float64, copy=True)
    buffers = np.array(momentum, dtype=np.float64, copy=True)
    weights = np.zeros(M)
    for m in chosen:
        out[m], buffers[m], _ = model.sgd_epochs(components[m], momentum[m], X, y, q[m],
                                                 config, rng)
        weights[m] = n
    return LocalUpdate(out, buffers, new_pi, weights, train_loss, estep_s,
                       time.perf_counter() - started - estep_s)


def aggregate_components(current: np.ndarray, updates: list[tuple[np.ndarray, np.ndarray]],
                         total_weight: float | np.ndarray | None = None) -> np.ndarray:
    """theta_m + sum_k w[k, m] (theta_{m,k} - theta_m) / Z_m for every component m.

    Parameters
    ----------
    current : ndarray of shape (M, P)
        The server's components before the round.
    updates : list of (components (M, P), weights (M,))
        The accepted replies.
    total_weight : float or ndarray (M,), optional
        Z_m. The authors' rule passes the total training size N of all training clients (a
        client not heard from counts as holding theta_m); None uses the replies' own total
        per component (an average over the replying clients). A component with Z_m = 0 keeps
        its value.
    """
    current = np.asarray(current, dtype=np.float64)
    delta = np.zeros_like(current)
    mass = np.zeros(current.shape[0])
    for theta, weights in updates:
        delta += weights[:, None] * (theta - current)
        mass += weights
    Z = mass if total_weight is None else np.broadcast_to(
        np.asarray(total_weight, dtype=np.float64), mass.shape)
    out = current.copy()
    live = Z > 0
    out[live] += delta[live] / Z[live, None]
    return out


def robust_aggregate_components(current: np.ndarray,
                                updates: list[tuple[np.ndarray, np.ndarray]],
                                total_weight: float | None = None, *,
                                aggregator: str = "trimmed-mean", trim: float = 0.2,
                                max_share: float = 1.0,
                                clip_factor: float = CLIP_FACTOR,
                                responsibilities: np.ndarray | None = None,
                                round_weight: float | None = None,
                                local_steps: np.ndarray | None = None) -> np.ndarray:
    """:func:`aggregate_components` made Byzantine-robust, component by component.

    For component m, the updates d_k = theta_{m,k} - theta_m of the devices that trained it
    (w[k, m] > 0), each divided by the device's responsibility r[k, m] for the component
    (``responsibilities``, its mean E-step responsibility, its new pi_m; 1 when not given):
    a device's update to a component scales with its responsibility for it (its local loss
    is responsibility-weighted), so d_k / r[k, m] are alike across honest devices whatever
    their mixtures, and robust statistics can compare them. With ``local_steps`` (tau_k,
    the number of local SGD steps device k took: epochs x ceil(n_k / batch)) each is also
    divided by tau_k, as FedNova (Wang et al. 2020) normalises: a device with 15 times the
    data takes 15 times the steps and moves 15 times as far, so without it the honest
    spread is the big devices' and a small device clipped to it pulls by many times its own
    update (FedEM's sign flip on 10 tasks: 5 to 8 points lost on seeds 2-5). Each device
    then weighs w[k, m] r[k, m]: the responsibility weights of FedEM. Those updates are

    1. clipped to the ball around their weighted coordinate-wise median of radius
       ``clip_factor`` times their weighted median distance to it
       (:func:`clip_around_median`; r floored at :data:`PI_FLOOR`): the radius measures
       the honest devices' spread, not the updates' size, so a device reversing or
       inflating its update lands where an honest outlier could be. The median weighs
       w[k, m] r[k, m] share-capped at ``max_share`` when the responsibilities are soft
       (a device with a tiny responsibility for a component sends a noisy d_k / r[k, m]),
       one vote per device when they are hard (IFCA's and CFL's clusters, one model: a
       cluster that CFL has yet to split holds two populations, and the heavier must not
       become the center that clips the other);
    2. weighted by w[k, m] with no device above a share of the average that uses them
       (:func:`~fmtl_flower.core.robust.cap_shares`): ``max_share`` of the component's
       weight, or, when every contributor gave the component all its data (IFCA's and
       CFL's clusters, one model: r[k, m] = 1), ``max_share`` of ``round_weight`` (the
       round's total weight, default the replies' sum of w r): a small cluster's devices
       keep their sizes rather than being equalised;
    3. combined coordinate by coordinate: ``trimmed-mean`` cuts, from each end of every
       coordinate of the K contributors, with hard assignments (r = 1) ``floor(trim * K)``
       whole devices (:func:`trimmed_device_count`, :func:`trimmed_mean_of_devices`), with
       FedEM's soft ones ``trim`` of the weight (most contributors to a component hold a
       tiny responsibility for it: cutting them by count would cut its owners; and a cut of
       floor(trim * K) / K of the weight jumps from 1/9 to 2/10 when a tenth device
       replies, which moved FedEM's few owners of a component by up to 1.5 points on 10
       tasks), the window's shares capped so that one device at an extreme is cut whole.
       Below 1 / trim contributors nothing is cut (a 3-device cluster is not reduced to its
       median): clipping and the share cap bound a device there. ``median`` takes the
       weighted median, ``mean`` the weighted mean (clipping and the share cap only).

    With ``local_steps`` the combined per-step update is scaled back by the devices' step
    counts tau_k combined as in 3 with the weights w[k, m] r[k, m] (FedNova's tau_eff: a
    claimed count at an extreme is cut like an update, and the caller bounds tau_k, since
    devices holding half the weight would set it). The step is the combined update times
    the component's share of the replies' data (their responsibilities r[k, m] combined as
    in 3 with the weights w[k, m]: one device claiming all the responsibility moves it by at
    most its capped share) times
    ``mass / Z_m`` (the replies' total weight over ``total_weight``, the authors' rule of a
    device not heard from holding theta_m; 1 with ``total_weight`` None): with every update
    at d_k = r[k, m] g and the mean, this is :func:`aggregate_components`'s step. A component
    nobody trained keeps its value.
    """
    if aggregator not in ROBUST_AGGREGATORS:
        raise ValueError(f"aggregator must be one of {ROBUST_AGGREGATORS}, got {aggregator!r}")
    current = np.asarray(current, dtype=np.float64)
    thetas = np.stack([theta for theta, _ in updates])  # (K, M, P)
    weights = np.stack([w for _, w in updates])  # (K, M)
    resp = np.ones_like(weights) if responsibilities is None else np.asarray(
        responsibilities, dtype=np.float64)
    if round_weight is None:
        round_weight = float((weights * resp).sum())
    steps = None if local_steps is None else np.asarray(local_steps, dtype=np.float64)
    out = current.copy()
    for m in range(current.shape[0]):
        live = weights[:, m] > 0
        if not live.any():
            continue
        r = np.maximum(resp[live, m], PI_FLOOR)
        w = weights[live, m] * r
        whole = bool(np.all(resp[live, m] == 1.0))  # hard assignments: clusters, one model
        cap = min(1.0, max_share * round_weight / float(w.sum())) if whole else max_share
        votes = np.ones_like(w) if whole else cap_shares(w, max_share)
        scale = r if steps is None else r * steps[live]
        deltas = clip_around_median((thetas[live, m] - current[m]) / scale[:, None], votes,
                                    clip_factor)
        step = _combine(deltas, w, aggregator, trim, cap, whole)
        if steps is not None:  # FedNova's tau_eff: the per-step update back to a round's
            step = step * _combine(steps[live, None], w, aggregator, trim, cap, whole)[0]
        share = _combine(r[:, None], weights[live, m], aggregator, trim, cap, whole)[0]
        mass = float(weights[live, m].sum())
        out[m] += step * share * (mass / total_weight if total_weight is not None else 1.0)
    return out


def clip_around_median(updates: np.ndarray, weights: np.ndarray,
                       clip_factor: float = CLIP_FACTOR) -> np.ndarray:
    """``updates`` (K, P) clipped to the ball around their weighted coordinate-wise median
    whose radius is ``clip_factor`` times the weighted median distance to it.

    The radius measures the honest devices' spread around their consensus (a minority of
    devices moves neither the median nor the median distance much), not the size of the
    updates: a device reversing or inflating its update ends up at most ``clip_factor``
    typical deviations from the consensus, as far as an honest outlier may be, and its pull
    on any average is its share times that. ``weights`` should give no device half of the
    total (share-capped): a device holding most of a small cluster's data must not be the
    center and make the radius 0. With one update, or all alike, nothing moves.
    """
    center = coordinate_median(updates, weights)
    distances = np.linalg.norm(updates - center, axis=1)
    radius = clip_factor * float(coordinate_median(distances, weights))
    return clip_to_ball(updates, center, radius)


def trimmed_device_count(trim: float, contributors: int) -> int:
    """How many devices a trimmed mean over ``contributors`` cuts from each end of a
    coordinate: floor(trim * K), so none below 1 / trim contributors (a cluster of 3 devices
    is averaged, not reduced to its median; clipping bounds a device there)."""
    return int(np.floor(trim * contributors + 1e-9))


def trimmed_mean_of_devices(points: np.ndarray, cut: int, weights: np.ndarray) -> np.ndarray:
    """Coordinate-wise weighted mean of the rows of ``points`` (K, P) after cutting the
    ``cut`` lowest and ``cut`` highest values of every coordinate (whole devices, whatever
    their weight; ``2 cut < K``)."""
    k = points.shape[0]
    if not 0 <= 2 * cut < k:
        raise ValueError(f"cannot cut {cut} devices from each end of {k}")
    order = np.argsort(points, axis=0, kind="stable")
    values = np.take_along_axis(points, order, axis=0)[cut:k - cut]
    kept = weights[order][cut:k - cut]
    return (values * kept).sum(axis=0) / kept.sum(axis=0)


def _combine(deltas: np.ndarray, weights: np.ndarray, aggregator: str, trim: float,
             max_share: float, whole: bool) -> np.ndarray:
    """The weighted coordinate-wise combination of the clipped updates (K, P) (step 3 of
    :func:`robust_aggregate_components`; ``whole``: every contributor gave the component
    all its data)."""
    k = deltas.shape[0]
    cut_devices = trimmed_device_count(trim, k) if aggregator == "trimmed-mean" else 0
    if aggregator == "mean" or (aggregator == "trimmed-mean" and cut_devices == 0):
        w = cap_shares(weights, max_share)
        return w @ deltas / w.sum()
    if aggregator == "trimmed-mean" and whole:
        return trimmed_mean_of_devices(deltas, cut_devices, cap_shares(
            weights, max_share * (k - 2 * cut_devices) / k))
    if aggregator == "trimmed-mean":
        fraction = trim
        w = cap_shares(weights, max_share * (1.0 - 2.0 * fraction))
        cut = max(fraction, float(w.max() / w.sum()))
        if cut < 0.5:
            return trimmed_mean(deltas, cut, w)
    else:
        w = cap_shares(weights, max_share)
    return coordinate_median(deltas, w)


def sample_clients(eligible: np.ndarray, fraction: float,
                   rng: np.random.Generator) -> np.ndarray:
    """max(1, floor(fraction * K)) of the K eligible ids, uniformly without replacement, sorted."""
    eligible = np.asarray(eligible)
    if eligible.size == 0:
        return eligible
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if fraction == 1:
        return np.sort(eligible)
    count = max(1, int(np.floor(fraction * eligible.size)))
    return np.sort(rng.choice(eligible, size=count, replace=False))


def learning_rate(base: float, server_round: int, num_rounds: int, schedule: str) -> float:
    """The round's learning rate: constant, or the authors' multi-step (x0.1 at rounds
    floor(R/2) and 3 floor(R/4))."""
    if schedule == "constant":
        return float(base)
    if schedule != "multi-step":
        raise ValueError(f"lr schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    factor = 1.0
    for milestone in (num_rounds // 2, 3 * (num_rounds // 4)):
        if milestone > 0 and server_round > milestone:
            factor *= 0.1
    return float(base) * factor
