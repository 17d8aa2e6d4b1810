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
  component's updates clipped to a radius from their median size, then a coordinate-wise
  weighted trimmed mean or median (Flower's ``FedTrimmedAvg`` / ``FedMedian``) with every
  device's share of the weight capped, so one device cannot steer a shared component;
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
    "aggregate_components", "robust_aggregate_components",
    "check_simplex", "component_losses", "e_step", "fit_mixture_weights", "learning_rate",
    "local_update", "mixture_log_likelihood", "mixture_proba", "sample_clients", "update_pi",
]

#: Smallest mixture weight a component keeps after a pi update.
PI_FLOOR = 1e-6
AGGREGATIONS = ("all", "sampled")
#: How robust mode combines a component's clipped updates (:func:`robust_aggregate_components`).
ROBUST_AGGREGATORS = ("trimmed-mean", "median", "mean")
#: Robust mode's clipping radius: this times the median size of the round's updates.
CLIP_FACTOR = 3.0
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
                                responsibilities: np.ndarray | None = None) -> np.ndarray:
    """:func:`aggregate_components` made Byzantine-robust, component by component.

    For component m, the updates d_k = theta_{m,k} - theta_m of the devices that trained it
    (w[k, m] > 0), each divided by the device's responsibility r[k, m] for the component
    (``responsibilities``, its mean E-step responsibility, its new pi_m; 1 when not given):
    a device's update to a component scales with its responsibility for it (its local loss
    is responsibility-weighted), so d_k / r[k, m] are alike across honest devices whatever
    their mixtures, and robust statistics can compare them. Each device then weighs
    w[k, m] r[k, m]: the responsibility weights of FedEM. Those updates are

    1. clipped to the ball of radius ``clip_factor`` times their weighted median norm (the
       weights share-capped as in 2; r floored at :data:`PI_FLOOR`)
       (:func:`~fmtl_flower.core.robust.coordinate_median`,
       :func:`~fmtl_flower.core.robust.clip_to_ball`): one device's update can be at most
       that large, whatever bound it was checked against;
    2. weighted by w[k, m] with no device above ``max_share`` of the average that uses them
       (:func:`~fmtl_flower.core.robust.cap_shares`): the weights stay the devices' example
       counts, only an outsized one is cut;
    3. combined coordinate by coordinate: ``trimmed-mean`` cuts ``trim`` of the weight from
       each end of every coordinate and averages the rest, the window of weight
       ``1 - 2 trim``: its shares are capped at ``max_share * (1 - 2 trim)`` first, so that
       no device carries more than ``max_share`` of the window either, and the cut is at
       least the largest share, so one device at an extreme is cut whole (with few devices,
       where the cap cannot hold below 1/K, that makes it the median); ``median`` takes the
       weighted median, ``mean`` the weighted mean (clipping and the share cap only).

    The step is the combined update times the component's share of the replies' data
    (their responsibilities r[k, m] combined as in 3 with the weights w[k, m]: one device
    claiming all the responsibility cannot enlarge the step) times ``mass / Z_m`` (the
    replies' total weight over ``total_weight``, the authors' rule of a device not heard
    from holding theta_m; 1 with ``total_weight`` None): with every update at
    d_k = r[k, m] g and the mean, this is :func:`aggregate_components`'s step. A component
    nobody trained keeps its value.
    """
    if aggregator not in ROBUST_AGGREGATORS:
        raise ValueError(f"aggregator must be one of {ROBUST_AGGREGATORS}, got {aggregator!r}")
    current = np.asarray(current, dtype=np.float64)
    thetas = np.stack([theta for theta, _ in updates])  # (K, M, P)
    weights = np.stack([w for _, w in updates])  # (K, M)
    resp = np.ones_like(weights) if responsibilities is None else np.asarray(
        responsibilities, dtype=np.float64)
    out = current.copy()
    for m in range(current.shape[0]):
        live = weights[:, m] > 0
        if not live.any():
            continue
        r = np.maximum(resp[live, m], PI_FLOOR)
        w = weights[live, m] * r
        deltas = (thetas[live, m] - current[m]) / r[:, None]
        sizes = np.linalg.norm(deltas, axis=1)
        radius = clip_factor * float(coordinate_median(sizes, cap_shares(w, max_share)))
        deltas = clip_to_ball(deltas, np.zeros(current.shape[1]), radius)
        step = _combine(deltas, w, aggregator, trim, max_share)
        share = _combine(r[:, None], weights[live, m], aggregator, trim, max_share)[0]
        mass = float(weights[live, m].sum())
        out[m] += step * share * (mass / total_weight if total_weight is not None else 1.0)
    return out


def _combine(deltas: np.ndarray, weights: np.ndarray, aggregator: str, trim: float,
             max_share: float) -> np.ndarray:
    """The weighted coordinate-wise combination of the clipped updates (K, P) (step 3 of
    :func:`robust_aggregate_components`)."""
    if aggregator == "mean":
        w = cap_shares(weights, max_share)
        return w @ deltas / w.sum()
    if aggregator == "trimmed-mean":
        w = cap_shares(weights, max_share * (1.0 - 2.0 * trim))
        cut = max(trim, float(w.max() / w.sum()))
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
