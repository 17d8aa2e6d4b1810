"""Estimated-time model of the MOCHA paper (appendix E.3, eq. (30)).

Per round h and node t::

    Time(h, t) = FLOPs(h, t) / ClockRate(t) + Comm(h, t),
    Comm(h, t) = latency + 64 * floats_down / down_bps + 64 * floats_up / up_bps,

(64 bits a float64; latency = one round trip; bandwidths in bit/s)

and the round lasts as long as its slowest participating node, or until the deadline
``clock_cycle`` when one is set (the server stops waiting then):
``min(clock_cycle, max_t Time(h, t))``.

FLOP counts (worst case: every visited coordinate changes, every sampled margin is < 1; a
multiply-add counts 2, a scalar op 1), ``d`` the dimension, per coordinate step / sample:

=========  =========  ===========  ==============================================================
method     per step   per round    what
=========  =========  ===========  ==============================================================
mocha      4d + 8     2d           dot x_i.v (2d), clip/scalars (8), axpy v += c x_i (2d);
                                   d_b = (v - w) / c at the end (2d)
cocoa      4d + 8     2d + checks  as MOCHA, plus ``n (2d + 6)`` per local-gap check (a margin
                                   and a gap term per sample), ``1 + ceil(steps / check_every)``
                                   checks (:func:`fmtl_flower.core.baselines.cocoa_local_update`)
mb-sdca    4d + 8     d            dot x_i.w (2d), scalars (8), axpy d_b += delta x_i (2d);
                                   d_b /= n (d)
mb-sgd     4d + 3     0            dot x_i.w (2d), compare (3), axpy g -= y_i x_i (2d)
=========  =========  ===========  ==============================================================

The table's 8 is the hinge's coordinate step. MOCHA, CoCoA and Mb-SDCA take the run's loss
(``loss``, default ``hinge``: :mod:`fmtl_flower.core.losses`), whose
:attr:`~fmtl_flower.core.losses.Loss.step_flops` replaces it: 8 for the hinge, the smoothed
hinge and the squared loss (closed-form steps), about 740 for the logistic loss (its
safeguarded Newton solve, ~15 iterations on average), what a registered loss declares.
Mb-SGD's 3 (the margin and the hinge's comparison) is likewise the loss's
:attr:`~fmtl_flower.core.losses.Loss.gradient_flops` (25 for the logistic loss's sigmoid).

All four move the same vectors: the device receives w_t and sends one d-vector (d_b or g),
so by default ``floats_down = floats_up = d`` (payload only: the few scalars of the wire
contract and the framing of Flower's messages are not modelled; the latency term dominates
them).

Constants
---------
``DEFAULT_CLOCK_RATE = 1e9`` FLOP/s: a smartphone application core at ~1-2 GHz sustaining
about one double-precision flop per cycle on these dependent dot/axpy loops (the order of the
mobile clock rates discussed by Van Berkel 2009, ref. [52] of the paper). Override per node to
model slow devices.

``NETWORKS`` (physical model). Representative round figures, chosen by us; only the LTE
throughputs are quoted medians, the rest are typical values of the same era (pick your own
with :class:`Network` when you have measurements):

- ``wifi``: RTT 20 ms, 20 Mbit/s down, 10 Mbit/s up -- WiFi gives lower latency and higher
  throughput than cellular access (Sommers and Barford, "Cell vs. WiFi: on the performance of
  metro area mobile connections", IMC 2012, Speedtest.net data).
- ``lte``: RTT 70 ms, 13 Mbit/s down, 6 Mbit/s up -- 13 / 6 Mbit/s are the median LTE
  throughputs of the 4GTest study (Huang et al., "A close examination of performance and power
  characteristics of 4G LTE networks", MobiSys 2012); 70 ms is the order of the LTE RTTs
  reported there (ref. [20] of the paper is the same group's SIGCOMM 2013 LTE study).
- ``3g``: RTT 200 ms, 1 Mbit/s down, 0.4 Mbit/s up -- typical UMTS/HSPA figures (RTTs of a
  few hundred ms, downlinks around 1 Mbit/s, uplinks of a few hundred kbit/s).

With these, one round's communication (~70 ms on LTE) equals ~1e5-1e6 local steps (d = 100 ... 9),
so local computation is almost free and estimated time is nearly ``rounds * RTT``.

``REFERENCE_NETWORKS`` reproduce the *relative* scale of the paper's experiments instead: the
reference code charges a fixed communication cost of k = 10 / 100 / 1000 flop-units per round
for WiFi / LTE / 3G ("scaling the communication cost relative to computation by one, two, or
three orders of magnitude", section 5.3 of the paper; the reference charges ~8 units per local
sample step). Here that is a latency of ``k / DEFAULT_CLOCK_RATE`` seconds with unlimited
bandwidth: one round's communication costs as much as k flops, so local computation dominates.
Use it to compare with the paper's figures.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.losses import Loss, get_loss

DEFAULT_CLOCK_RATE = 1.0e9
BYTES_PER_FLOAT = 8

# method -> (a, b, c): per-step FLOPs a*d + b, per-round FLOPs c*d; b is the hinge's step
# (a coordinate step's b is the run's loss's Loss.step_flops, :func:`per_step_flops`)
FLOP_COUNTS: dict[str, tuple[int, int, int]] = {
    "mocha": (4, 8, 2),
    "cocoa": (4, 8, 2),
    "mb-sdca": (4, 8, 1),
    "mb-sgd": (4, 3, 0),
}
METHODS = tuple(FLOP_COUNTS)
#: The methods whose local step is an SDCA coordinate step of the run's loss.
COORDINATE_METHODS = ("mocha", "cocoa", "mb-sdca")
# per sample of one CoCoA local-gap check: (2d + 6)
_CHECK = (2, 6)


@dataclass(frozen=True)
class Network:
    """A network link: round-trip latency (s) and bandwidths (bit/s) in both directions."""

    name: str
    latency_s: float
    down_bps: float
    up_bps: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s must be a finite number >= 0, got {self.latency_s}")
        for key in ("down_bps", "up_bps"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0 (inf allowed), got {getattr(self, key)}")

    def comm_time(self, floats_down: float, floats_up: float,
                  bytes_per_float: int = BYTES_PER_FLOAT) -> float:
        """Seconds for one round's exchange: latency + bits down / down_bps + bits up / up_bps."""
        bits = 8.0 * bytes_per_float
        return (self.latency_s + bits * floats_down / self.down_bps
                + bits * floats_up / self.up_bps)


NETWORKS: dict[str, Network] = {
    "wifi": Network("wifi", 0.020, 20e6, 10e6),
    "lte": Network("lte", 0.070, 13e6, 6e6),
    "3g": Network("3g", 0.200, 1e6, 0.4e6),
}

REFERENCE_NETWORKS: dict[str, Network] = {
    name: Network(f"{name}-reference", units / DEFAULT_CLOCK_RATE, math.inf, math.inf)
    for name, units in (("wifi", 10.0), ("lte", 100.0), ("3g", 1000.0))
}

NetworkLike = str | Network


def get_network(network: NetworkLike, *, model: str = "physical") -> Network:
    """Resolve ``"wifi" | "lte" | "3g"`` in ``NETWORKS`` (``model="physical"``) or
    ``REFERENCE_NETWORKS`` (``model="reference"``); a :class:`Network` passes through."""
    if isinstance(network, Network):
        return network
    table = {"physical": NETWORKS, "reference": REFERENCE_NETWORKS}.get(model)
    if table is None:
        raise ValueError(f"model must be 'physical' or 'reference', got {model!r}")
    try:
        return table[str(network).lower()]
    except KeyError:
        raise ValueError(f"network must be one of {list(table)} or a Network, "
                         f"got {network!r}") from None


def _method(method: str) -> tuple[int, int, int]:
    try:
        return FLOP_COUNTS[method]
    except KeyError:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}") from None


def per_step_flops(method: str, loss: str | Loss = "hinge") -> tuple[float, float, float]:
    """(a, b, c) of ``method`` (per-step FLOPs a d + b, per-round c d) for the run's ``loss``
    (a name or a registered :class:`~fmtl_flower.core.losses.Loss`): FLOP_COUNTS's, with b
    the loss's ``step_flops`` for a coordinate method and its ``gradient_flops`` for Mb-SGD
    (the hinge's 8 and 3: FLOP_COUNTS's own). ValueError for an unknown method or loss."""
    a, _, c = _method(method)
    resolved = get_loss(loss)
    if method in COORDINATE_METHODS:
        return a, resolved.step_flops, c
    return a, resolved.gradient_flops, c


def _dim(dim: int) -> int:
    if isinstance(dim, bool) or int(dim) != dim or dim < 1:
        raise ValueError(f"dim must be an integer >= 1, got {dim}")
    return int(dim)


def _cocoa_args(method, num, n, check_every):
    if method != "cocoa":
        return None, None
    if n is None:
        raise ValueError("method 'cocoa' needs n (samples per node) to charge its gap checks")
    n = np.broadcast_to(np.asarray(n, dtype=np.float64), (num,))
    if np.any(n < 0):
        raise ValueError("n must be >= 0")
    if check_every is None:
        ce = np.maximum(n, 1.0)
    else:
        ce = np.broadcast_to(np.asarray(check_every, dtype=np.float64), (num,))
        if np.any(ce < 1):
            raise ValueError("check_every must be >= 1")
    return n, ce


def local_flops(steps: np.ndarray, dim: int, method: str, *, loss: str | Loss = "hinge",
                n=None, check_every=None) -> np.ndarray:
    """FLOPs of each node's local work in one round (see the module's table).

    Parameters
    ----------
    steps : array_like of shape (k,)
        Coordinate steps (CoCoA, MOCHA, Mb-SDCA) or sampled points (Mb-SGD) per node, >= 0.
    dim : int
        Feature dimension d.
    method : {"mocha", "cocoa", "mb-sdca", "mb-sgd"}
    loss : str or Loss
        The run's loss, whose coordinate step costs :func:`per_step_flops`'s b (default
        ``hinge``, the table's).
    n, check_every : array_like or int, optional
        CoCoA only (required ``n``): samples per node and steps between gap checks
        (default n), to charge ``1 + ceil(steps / check_every)`` passes of ``n (2d + 6)``.
    """
    a, b, c = per_step_flops(method, loss)
    d = _dim(dim)
    steps = np.atleast_1d(np.asarray(steps, dtype=np.float64))
    if steps.ndim != 1 or np.any(steps < 0) or not np.all(np.isfinite(steps)):
        raise ValueError(f"steps must be a 1-D array of finite numbers >= 0, got {steps!r}")
    flops = steps * (a * d + b) + c * d
    n_arr, ce = _cocoa_args(method, steps.shape[0], n, check_every)
    if n_arr is not None:
        checks = 1.0 + np.ceil(steps / ce)
        flops = flops + checks * n_arr * (_CHECK[0] * d + _CHECK[1])
    return flops


def _per_node(value, num, name):
    arr = np.broadcast_to(np.asarray(value, dtype=np.float64), (num,))
    if not np.all(np.isfinite(arr) & (arr > 0)):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return arr


def _comm(network, num, dim, floats_down, floats_up, model, bytes_per_float):
    one = not isinstance(network, Sequence) or isinstance(network, str)
    nets = [get_network(network, model=model)] if one else [
        get_network(x, model=model) for x in network]
    if not one and len(nets) != num:
        raise ValueError(f"network must be one network or {num} of them, got {len(nets)}")
    fd = dim if floats_down is None else floats_down
    fu = dim if floats_up is None else floats_up
    if fd < 0 or fu < 0:
        raise ValueError("floats_down and floats_up must be >= 0")
    if one:  # one link for every node: one time
        return np.full(num, nets[0].comm_time(fd, fu, bytes_per_float))
    return np.array([net.comm_time(fd, fu, bytes_per_float) for net in nets])


def node_times(
    steps: np.ndarray,
    dim: int,
    method: str,
    network: NetworkLike | Sequence[NetworkLike],
    *,
    clock_rate: float | np.ndarray = DEFAULT_CLOCK_RATE,
    loss: str | Loss = "hinge",
    n=None,
    check_every=None,
    floats_down: float | None = None,
    floats_up: float | None = None,
    bytes_per_float: int = BYTES_PER_FLOAT,
    model: str = "physical",
) -> np.ndarray:
    """Eq. (30) per node: ``local_flops / clock_rate + comm_time`` in seconds.

    Parameters
    ----------
    steps : array_like of shape (k,)
        Local steps (or sampled points) of each node in the round.
    dim : int
        Feature dimension d.
    method : {"mocha", "cocoa", "mb-sdca", "mb-sgd"}
    network : "wifi" | "lte" | "3g" | Network, or a sequence of k of them
        One link for every node, or one per node.
    clock_rate : float or array_like of shape (k,)
        FLOP/s of each device (> 0).
    loss : str or Loss
        The run's loss (its coordinate step's cost, :func:`local_flops`); ``hinge`` default.
    n, check_every
        CoCoA's gap-check accounting, see :func:`local_flops`.
    floats_down, floats_up : float, optional
        Floats received / sent per round (default d each).
    bytes_per_float : int
        8 (float64, the wire format) by default.
    model : {"physical", "reference"}
        Which table network names refer to (module docstring).
    """
    flops = local_flops(steps, dim, method, loss=loss, n=n, check_every=check_every)
    k = flops.shape[0]
    rate = _per_node(clock_rate, k, "clock_rate")
    return flops / rate + _comm(network, k, int(dim), floats_down, floats_up, model,
                                bytes_per_float)


def round_time(
    steps_per_node: np.ndarray,
    dim: int,
    method: str,
    network: NetworkLike | Sequence[NetworkLike],
    *,
    clock_cycle: float | None = None,
    participating: np.ndarray | None = None,
    **kwargs,
) -> float:
    """Estimated duration of one round: its slowest participating node, capped by the deadline.

    ``max_t node_times[t]`` over the participating nodes (those the server waits for); with
    ``clock_cycle`` set, ``min(clock_cycle, that max)``: the server closes the round at the
    deadline, or earlier once every reply is in. 0.0 if no node participates. A reply that is
    lost silently (the server cannot tell it from a slow one) keeps the server waiting until
    the deadline: such a round lasts ``clock_cycle`` (or the round timeout without a deadline),
    whatever this function returns for the others. Keyword arguments go to :func:`node_times`.
    """
    times = node_times(steps_per_node, dim, method, network, **kwargs)
    if participating is not None:
        participating = np.asarray(participating, dtype=bool)
        if participating.shape != times.shape:
            raise ValueError(f"participating must have shape {times.shape}, "
                             f"got {participating.shape}")
        times = times[participating]
    if clock_cycle is not None:
        _check_deadline(clock_cycle)
    if times.size == 0:
        return 0.0
    slowest = float(times.max())
    return slowest if clock_cycle is None else min(float(clock_cycle), slowest)


def _node_options(caller: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` given to ``caller`` as :func:`node_times`'s keyword arguments, with its
    defaults for the others (its signature is their one definition); TypeError for a key it
    does not take."""
    defaults = {p.name: p.default for p in inspect.signature(node_times).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    for key in options:
        if key not in defaults:
            raise TypeError(f"{caller}() got an unexpected keyword argument {key!r}")
    return {**defaults, **options}


def _check_deadline(clock_cycle):
    if not (math.isfinite(clock_cycle) and clock_cycle > 0):
        raise ValueError(f"clock_cycle must be a finite number of seconds > 0, got {clock_cycle}")


def steps_within_deadline(
    clock_cycle: float,
    dim: int,
    method: str,
    network: NetworkLike | Sequence[NetworkLike],
    *,
    num_nodes: int | None = None,
    budgets: np.ndarray | None = None,
    **options: Any,
) -> np.ndarray:
    """The most local steps each node can do and still reply by the deadline.

    Stragglers cut their work instead of making the round wait: node t gets
    ``floor((clock_cycle - Comm_t) * rate_t - round_flops) / step_flops)`` steps (at least 0),
    and at most ``budgets[t]`` when given. 0 also marks a node whose communication alone misses
    the deadline (it cannot reply in time: treat it as dropped). For CoCoA the gap checks are
    charged conservatively (``ceil(s / ce) <= s / ce + 1``), so the cap never overruns.

    Parameters
    ----------
    clock_cycle : float
        Deadline in seconds (> 0).
    dim, method, network
        As for :func:`node_times`.
    num_nodes : int, optional
        Number of nodes k (or taken from ``budgets`` / per-node arrays).
    budgets : array_like of shape (k,), optional
        Work each node would do without a deadline; the result never exceeds it.
    **options
        :func:`node_times`'s keyword arguments (``clock_rate``, ``loss``, ``n``,
        ``check_every``,
        ``floats_down``, ``floats_up``, ``bytes_per_float``, ``model``), same defaults.

    Returns
    -------
    ndarray of shape (k,), int64
    """
    _check_deadline(clock_cycle)
    o = _node_options("steps_within_deadline", options)
    clock_rate, n = o["clock_rate"], o["n"]
    a, b, c = per_step_flops(method, o["loss"])
    d = _dim(dim)
    k = num_nodes
    for cand in (budgets, clock_rate, n):
        if k is None and cand is not None and np.ndim(cand) == 1:
            k = len(cand)
    if k is None and isinstance(network, Sequence) and not isinstance(network, str):
        k = len(network)
    if k is None:
        raise ValueError("give num_nodes, budgets, or per-node clock_rate / n / network")
    rate = _per_node(clock_rate, k, "clock_rate")
    comm = _comm(network, k, d, o["floats_down"], o["floats_up"], o["model"],
                 o["bytes_per_float"])
    avail = (clock_cycle - comm) * rate - c * d
    per_step = np.full(k, float(a * d + b))
    n_arr, ce = _cocoa_args(method, k, n, o["check_every"])
    if n_arr is not None:
        check = n_arr * (_CHECK[0] * d + _CHECK[1])
        avail = avail - 2.0 * check
        per_step = per_step + check / ce
    with np.errstate(invalid="ignore"):
        caps = np.floor(np.maximum(avail, 0.0) / per_step)
    caps = np.where(avail > 0, caps, 0.0)
    if budgets is not None:
        budgets = np.asarray(budgets)
        if budgets.shape != (k,) or np.any(budgets < 0):
            raise ValueError(f"budgets must be {k} numbers >= 0, got {budgets!r}")
        caps = np.minimum(caps, budgets)
    return caps.astype(np.int64)


def deadline_budgets(budgets: np.ndarray, clock_cycle: float | None, dim: int, method: str,
                     network: NetworkLike, *, model: str = "physical",
                     n: np.ndarray | None = None,
                     loss: str | Loss = "hinge") -> np.ndarray:
    """``budgets`` capped by what each node can do within ``clock_cycle`` (None: unchanged).

    ``n`` (the nodes' sample counts) is needed for CoCoA, whose gap checks cost a pass each;
    ``loss`` is the run's (its step's cost, :func:`per_step_flops`).
    """
    budgets = np.asarray(budgets, dtype=np.int64)
    if clock_cycle is None or len(budgets) == 0:
        return budgets
    return steps_within_deadline(clock_cycle, dim, method, network, budgets=budgets, model=model,
                                 n=n, loss=loss)
