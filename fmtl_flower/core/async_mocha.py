"""Barrier-free MOCHA (issue 28), free of any Flower dependency.

No round waits for the slowest device: the server keeps up to ``concurrency`` requests in
flight, applies each reply as it arrives and sends new work to the device that replied. The
server state is MOCHA's (:class:`~fmtl_flower.core.mocha.MOCHAServerState`: B, M = K^-1 and
W = B M), kept exact after every single reply by a rank-one update. The guarantees, with
their proofs, are in ``docs/guides/async-mocha.md``; in short:

* **Stale updates are safe.** A request is computed against the W of some *version* (the
  number of replies applied so far). A reply is applied only if at most ``tau`` replies were
  applied since its request left (its *staleness*); the others are rejected (theta = 1, the
  device discards its step). With at most ``K_c = concurrency`` requests in flight, every
  applied update overlaps at most ``tau + K_c - 1`` others, so the local subproblems' sigma'
  of :func:`async_sigma_prime`, ``gamma (1 + (tau + K_c - 1) max_{s != t} |N_ts|)`` with
  ``N = D^-1/2 M D^-1/2``, keeps the dual of every prefix of applied updates at least its
  start value (it is never above ``gamma (tau + K_c)``; for uncoupled tasks it is gamma,
  whatever the staleness, and in the synchronous case, where each pair of updates overlaps
  once, the same argument gives Lemma 9's row sum ``gamma sum_s |N_ts|``).
* **Safeguard.** A reply also carries the change of its conjugate term,
  ``delta A_t = (1/n_t) sum_i y_ti d_alpha_ti``. Applied with a factor g in [0, 1] at the
  *current* state, the dual changes by ``g a - g^2 h / 2`` with ``a = delta A_t - w_t . d_b``
  (``w_t`` the current model) and ``h = M_tt |d_b|^2`` (the regulariser is quadratic), so the
  server applies ``g = gamma`` when that change is >= 0 (always for a fresh update), else the
  maximiser ``clip(a / h, 0, gamma)`` (:func:`safeguard_gamma`): the dual never decreases,
  whatever the actual staleness.
* **Commit protocol per reply.** The device keeps its step pending; the next request to it
  names the newest applied request of its task and the factor g applied to it, and the device
  commits ``g d_alpha`` only if they match (otherwise it discards the step: lost, expired,
  duplicated, rejected and too-stale replies all count as theta = 1). A device whose
  committed state differs from the server's restarts from alpha = 0 and says so; the server
  resets b_t. So alpha on the devices and B on the server never drift apart.
* **Certificate without a barrier.** The server tracks the dual exactly (sum of the A_t it
  applied minus the regulariser of the consistent pair). Each reply reports the loss of the
  model its request carried; the primal is evaluated on those models, ``W_eval`` (column t:
  the model task t last evaluated its loss on), with the current K, and ``P(W_eval) - D(alpha)``
  is the certified gap: weak duality holds for any pair, so it bounds both ``P(W_eval) - P*``
  and ``D* - D(alpha)``. Per-task gaps of different versions are never summed.
* **Checks of a reply** (:class:`ReplyBounds`, as synchronous MOCHA's,
  :mod:`fmtl_flower.strategies.mocha`): with R_t the bound on task t's training-row norms,
  ``0 <= loss-mean <= 1 + R_t |w_t|``, ``|d_b| <= R_t min(budget, n_t) / n_t`` and, in
  robust mode, ``|b_t + d_b| <= R_t`` (b_t the task's image on the server, 0 after a
  restart: no feasible alpha has a larger one, however its steps are spread over replies).
  And the certificate's check (:mod:`fmtl_flower.core.certificate`, always on): the reported
  pair, ``loss-mean - dual-mean + w . b_t >= 0`` (w the request's model, b_t before the
  update), and the pair the certificate will use, ``loss-mean - A_t' + w . b_t' >= 0`` with
  A_t', b_t' the server's conjugate term and image *after* the update scaled by g. A reply
  that fails any of them is ``invalid`` (theta = 1) and changes nothing. Why the last one
  makes every certified gap >= 0: ``P(W_eval) - D(alpha) = sum_t (L_t - A_t + w_t . b_t) +
  (1/2) tr((W_eval - B M) K (W_eval - B M)^T)``, and each task's (L_t, A_t, b_t, w_t)
  changes only when its own reply is applied, so each summand is a pair that passed the
  check; the quadratic term is >= 0 (the certificate never comes from a forged pair).
* **Omega-steps** drain: no new work is sent until every request in flight has come back
  (or expired), then Omega and sigma' are updated and W <- B M.
* **Any loss** of :mod:`fmtl_flower.core.losses` (hinge, smoothed hinge, logistic,
  squared). The device's SDCA steps, ``loss_mean`` and ``dual_mean`` are the loss's, and
  ``delta A_t`` is the change of its conjugate term by the whole step,
  ``(1/n) sum_i [D(a_i + d_i) - D(a_i)]`` with ``a_i = y_i alpha_i``
  (:func:`conjugate_change`). D is concave, so the change by the step scaled by g is at
  least the chord ``g delta A_t``: the safeguard's ``g a - g^2 h / 2`` above is a lower bound
  of the dual's change, exact for the hinge's linear D and for g in {0, 1}, and the factor
  it picks never lowers the dual. The server adds the chord to A_t; after a step applied
  with 0 < g < 1 under a curved D it knows A_t only from below (its dual is then a lower
  bound of D(alpha), and every certified gap stays an upper bound) until the task's next
  reply, whose ``dual_mean`` is the exact value at the same alpha (the device committed
  exactly ``g d_alpha``): the server takes it if it is larger, so the dual is again exact,
  and still never decreases. The bounds take the loss's value bound and dual radius (none
  on ``|d_b|`` or the dual image for the squared loss, whose dual is unbounded), the
  certificate's check the loss's dual range. The intercept and multi-class are synchronous
  MOCHA's lifting (:mod:`fmtl_flower.core.multiclass`): the devices change their rows, the
  protocol is unchanged.
* **Decoupling** (robust mode: ``bounds.robust``). Every m applied replies (a round of
  work) the server feeds :class:`~fmtl_flower.core.decoupling.OutlierWatch` what
  synchronous MOCHA feeds it every round: each task's largest |d_b| since the last check
  over its bound ``scale_t min(budget_t, n_t) / n_t`` (:func:`~fmtl_flower.core.decoupling.
  federation_scale` of the R_t), |b_t|, B, and for a learned Omega the coupling weights of
  M. A task it finds is decoupled (M -> M', :mod:`fmtl_flower.core.decoupling`; W <- B M',
  then sigma' and K) and logged. Why at once, with requests in flight: M' keeps the coupled
  tasks' block of M and zeroes the decoupled task's coupling, so every in-flight request's
  sigma' stays safe (the max |N_ts| only falls), and the safeguard computes each reply's
  factor at the *current* state (m_tt, w_t of M'), so no reply can lower the (new) dual
  whatever it was computed for. The switch itself changes the problem (K' = M'^-1, as in
  synchronous MOCHA), so the dual is monotone between switches. Without the safeguard that
  argument fails for the decoupled task's own requests in flight, so the decoupling then
  waits for the next drain (:meth:`AsyncMOCHAServer.omega_step`).

:func:`simulate_async_mocha` runs the protocol on a virtual clock: task t's k-th request
takes ``seconds[t]`` (eq. (30)'s time, :func:`fmtl_flower.systems.timing.node_times`) times
the log-normal factor :func:`latency_factor` ``(seed, t, k)``; :func:`simulate_sync_mocha`
runs synchronous MOCHA with a deadline on the same clock and the same draws.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .baselines import cocoa_local_update
from .certificate import REASON_PREFIX, pair_problems
from .decoupling import OutlierWatch, coupling_weights, federation_scale
from .formulations import Formulation, make_formulation
from .hinge import hinge_conjugate_value
from .losses import Loss, get_loss
from .mocha import MOCHAServerState
from .rng import TAG_AVAILABILITY, TAG_LATENCY, TAG_LATENCY_DEVICE, coordinate_order
from .sdca import sdca_local_update

TaskArrays = tuple[np.ndarray, np.ndarray]

LOGGER = logging.getLogger(__name__)

#: A device's committed request id after a restart from alpha = 0 that the server has not
#: confirmed yet (request ids are >= 1, 0 is "none applied").
RESTARTED = -1

#: Outcomes of :meth:`AsyncMOCHAServer.receive`.
APPLIED, STALE, UNKNOWN, INVALID = "applied", "stale", "unknown", "invalid"


# ----------------------------------------------------------------------------- the math


def coupling_max(M: np.ndarray) -> np.ndarray:
    """``nu_t = max_{s != t} |N_ts|`` with ``N = D^-1/2 M D^-1/2``, ``D = diag(M)``, per task.

    Each ``|N_ts| <= 1`` (M is positive definite); all are 0 for uncoupled tasks.
    """
    M = np.asarray(M, dtype=np.float64)
    scale = 1.0 / np.sqrt(np.diag(M))
    N = np.abs(M * np.outer(scale, scale))
    np.fill_diagonal(N, 0.0)
    return N.max(axis=1) if M.shape[0] > 1 else np.zeros(M.shape[0])


def async_sigma_prime(M: np.ndarray, tau: int | None, concurrency: int,
                      gamma: float = 1.0) -> np.ndarray:
    """The per-task sigma' that makes updates of staleness <= ``tau`` safe.

    ``sigma'_t = gamma (1 + (tau + concurrency - 1) nu_t)`` with ``nu_t`` of
    :func:`coupling_max` (module docstring). ``tau=None`` (no staleness bound) is only
    possible for uncoupled tasks (every ``nu_t = 0``), where sigma' is gamma.

    Raises
    ------
    ValueError
        ``tau`` None while some tasks are coupled, or bad ``tau`` / ``concurrency``.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    nu = coupling_max(M)
    if tau is None:
        if np.any(nu > 0):
            raise ValueError("tau (the staleness bound) must be set when tasks are coupled "
                             "(M has off-diagonal entries)")
        return np.full(nu.shape, float(gamma))
    if tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    return gamma * (1.0 + (tau + concurrency - 1) * nu)


#: How the server picks the local subproblems' sigma': ``stale-safe`` (:func:`async_sigma_prime`:
#: every prefix of applied updates keeps the dual, even without the safeguard) or
#: ``synchronous`` (Lemma 9's row sum, as synchronous MOCHA's ``global`` sigma': smaller, so
#: larger steps; only with the safeguard, which alone then keeps the dual monotone).
SIGMA_PRIME_RULES = ("stale-safe", "synchronous")


def safeguard_gamma(ascent: float, curvature: float, cap: float = 1.0) -> float:
    """The factor in [0, cap] applied to one reply: ``cap`` when the full step does not lower
    the dual, else the maximiser of ``g ascent - g^2 curvature / 2``.

    That expression is the dual's change when one task's update is applied scaled by g at
    the current state (module docstring: ``ascent = delta A_t - w_t . d_b``,
    ``curvature = M_tt |d_b|^2``), so the result never makes the dual worse (g = 0 is
    allowed). A fresh update (staleness 0) always gets ``cap``: its local subproblem's value
    ``ascent - sigma' curvature / 2 >= 0`` with ``sigma' >= cap``; so the safeguard leaves
    MOCHA unchanged wherever a step cannot hurt.
    """
    if not (math.isfinite(ascent) and math.isfinite(curvature)) or curvature < 0:
        return 0.0
    if cap * (ascent - 0.5 * cap * curvature) >= 0.0:
        return float(cap)
    if curvature == 0.0:  # d_b = 0 and a negative conjugate change: nothing to gain
        return 0.0
    return float(min(max(ascent / curvature, 0.0), cap))


def latency_factor(seed: int, task: int, request: int, sigma: float,
                   persistence: float = 0.0) -> float:
    """The log-normal factor of task ``task``'s ``request``-th request (1-based) under
    ``seed``: ``exp(sigma (sqrt(1 - p) z_tk + sqrt(p) z_t))`` with z_tk ~ N(0, 1) drawn for
    each request and z_t ~ N(0, 1) drawn once per device (1.0 when sigma is 0).

    ``persistence`` p in [0, 1] is the share of the log-variance that belongs to the device:
    0 (the default, the first model) draws every request independently; 1 makes a slow
    device slow on every request (its factor is fixed); in between, a persistent device
    factor times a per-request one. Every request's factor has the same law for every p
    (log-normal, log-sd sigma, median 1), so runs under different p meet equally slow
    requests on average and differ only in how the slowness is spread over the devices.
    Synchronous round k draws the same factor as the k-th request, so both protocols meet
    the same delays.
    """
    if sigma < 0 or not math.isfinite(sigma):
        raise ValueError(f"latency-sigma must be a finite number >= 0, got {sigma}")
    if not 0.0 <= persistence <= 1.0:
        raise ValueError(f"latency-persistence must be in [0, 1], got {persistence}")
    if sigma == 0.0:
        return 1.0
    z = 0.0
    if persistence < 1.0:
        z_request = np.random.default_rng(
            [int(seed), int(task), int(request), TAG_LATENCY]).standard_normal()
        z += math.sqrt(1.0 - persistence) * z_request if persistence else z_request
    if persistence > 0.0:
        z_device = np.random.default_rng(
            [int(seed), int(task), TAG_LATENCY_DEVICE]).standard_normal()
        z += math.sqrt(persistence) * z_device
    return float(math.exp(sigma * z))


@dataclass(frozen=True)
class Availability:
    """Devices that go offline for a while: each device alternates online and offline
    windows of exponential lengths, offline ``offline_fraction`` of the time on average, each
    offline window ``mean_offline_s`` virtual seconds on average (online windows:
    ``mean_offline_s (1 - f) / f``); a device starts offline with probability f. Drawn per
    device from the stream ``[seed, t, TAG_AVAILABILITY]`` (:mod:`fmtl_flower.core.rng`).

    On the virtual clock the server sends work only to online devices (a deployment's
    SuperLink knows the connected nodes); a device that goes offline before its reply is
    sent loses it, and the server counts the request expired (theta = 1) when the device
    disconnects. The synchronous baseline meets the same windows: a round trains only the
    devices online when it starts and waits for a lost reply until the disconnect (or its
    deadline).
    """

    offline_fraction: float
    mean_offline_s: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.offline_fraction < 1.0:
            raise ValueError("availability: the offline fraction must be in [0, 1), got "
                             f"{self.offline_fraction}")
        if not (math.isfinite(self.mean_offline_s) and self.mean_offline_s > 0):
            raise ValueError("availability: the mean offline duration must be a finite "
                             f"number of seconds > 0, got {self.mean_offline_s}")

    def schedule(self, seed: int, num_tasks: int) -> AvailabilitySchedule:
        """The windows of ``num_tasks`` devices under ``seed``."""
        return AvailabilitySchedule(self, seed, num_tasks)


class AvailabilitySchedule:
    """The online / offline windows of each device (:class:`Availability`), drawn lazily and
    in order from each device's own stream: the same seed gives the same windows whatever
    the order of the questions asked."""

    def __init__(self, availability: Availability, seed: int, num_tasks: int) -> None:
        f, d = availability.offline_fraction, availability.mean_offline_s
        self.mean = (d * (1.0 - f) / f, d) if f > 0 else None  # (online, offline) means
        self._rngs = [np.random.default_rng([int(seed), t, TAG_AVAILABILITY])
                      for t in range(num_tasks)]
        # edges[t]: times where device t's state flips; starts_online[t]: its state at 0
        self._starts_online = [self.mean is None or bool(rng.random() >= f)
                               for rng in self._rngs]
        self._edges: list[list[float]] = [[0.0] for _ in range(num_tasks)]

    def _window(self, task: int, time_s: float) -> tuple[int, float, float]:
        """(index, start, end) of device ``task``'s window containing ``time_s``."""
        edges = self._edges[task]
        while edges[-1] <= time_s:
            online = self._online_in(task, len(edges) - 1)
            edges.append(edges[-1] + self._rngs[task].exponential(self.mean[0 if online else 1]))
        i = bisect.bisect_right(edges, time_s) - 1
        return i, edges[i], edges[i + 1]

    def _online_in(self, task: int, index: int) -> bool:
        return self._starts_online[task] == (index % 2 == 0)

    def online_until(self, task: int, time_s: float) -> float | None:
        """When device ``task``, online at ``time_s``, goes offline (inf: never); None if it
        is offline at ``time_s``."""
        if self.mean is None:
            return math.inf
        i, _, end = self._window(task, time_s)
        return end if self._online_in(task, i) else None

    def next_online(self, task: int, time_s: float) -> float:
        """The first time >= ``time_s`` when device ``task`` is online."""
        if self.mean is None:
            return time_s
        i, _, end = self._window(task, time_s)
        return time_s if self._online_in(task, i) else end


# ----------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Request:
    """One unit of work sent to a task's device.

    ``request_id``: unique in the run (>= 1); ``count``: this task's request number k
    (1-based), which keys the coordinate order as synchronous MOCHA's round k does.
    ``confirm_id`` / ``confirm_gamma``: the newest request of this task whose reply the
    server applied (0: none) and the factor it applied, for the device's commit.
    ``keep_id``: this task's ``confirm_id`` at the server's newest checkpoint (0: none); the
    device keeps its newest committed state not after it, to go back to if the server
    resumes from that checkpoint. ``loss``: the run's loss (:data:`~fmtl_flower.core.
    losses.LOSSES`).
    """

    task: int
    request_id: int
    count: int
    version: int
    w: np.ndarray
    m_tt: float
    sigma_prime: float
    budget: int
    seed: int
    confirm_id: int
    confirm_gamma: float
    method: str = "mocha"
    theta: float = 0.5
    keep_id: int = 0
    loss: str = "hinge"


#: The local solvers: MOCHA's SDCA for ``budget`` steps, or CoCoA's (SDCA until the local
#: gap falls by ``theta``, at most ``budget`` steps).
METHODS = ("mocha", "cocoa")


@dataclass(frozen=True)
class Reply:
    """A device's answer to a :class:`Request`.

    ``d_b = X^T d_alpha / n``; ``delta_dual = (1/n) sum_i [D(y_i (alpha_i + d_alpha_i)) -
    D(y_i alpha_i)]``, the change of the conjugate term by the whole step (the hinge's
    ``(1/n) sum y d_alpha``); ``loss_mean``: the mean loss at the request's w; ``dual_mean``:
    ``(1/n) sum D(y alpha)`` after the commit, before this step (:mod:`fmtl_flower.core.
    losses`); ``state_ok``: False when the device restarted from alpha = 0.
    """

    task: int
    request_id: int
    d_b: np.ndarray
    delta_dual: float
    loss_mean: float
    dual_mean: float
    steps: int
    state_ok: bool = True


@dataclass(frozen=True)
class ReplyBounds:
    """What the server checks each reply's numbers against (module docstring, "Checks").

    Parameters
    ----------
    row_norm : ndarray of shape (m,)
        R_t, the bound on task t's training-row norms (the strategy's, fenced in robust
        mode; NaN: none known, every reply of the task is rejected).
    n_train : ndarray of shape (m,)
        n_t, the task's training rows (as its device reported them).
    robust : bool
        Also bound the dual image a reply would leave, ``|b_t + d_b| <= R_t``.
    slack : float
        Relative rounding slack of the bounds (as
        :data:`fmtl_flower.strategies.trust.BOUND_SLACK`).
    loss : str or Loss
        The run's loss: its value bound caps ``loss-mean``, its dual radius (1, or inf for
        the squared loss) scales the bounds on ``delta-b`` and on the dual image (as
        synchronous MOCHA's, :mod:`fmtl_flower.strategies.mocha`).
    """

    row_norm: np.ndarray
    n_train: np.ndarray
    robust: bool = True
    slack: float = 1.0 + 1e-6
    loss: str | Loss = "hinge"

    @classmethod
    def of_tasks(cls, tasks: Sequence[TaskArrays], robust: bool = True,
                 loss: str | Loss = "hinge") -> ReplyBounds:
        """The true bounds of the tasks' data (the simulation knows them)."""
        return cls(np.array([float(np.sqrt(np.einsum("ij,ij->i", X, X).max(initial=0.0)))
                             for X, _ in tasks]),
                   np.array([X.shape[0] for X, _ in tasks], dtype=np.int64), robust,
                   loss=loss)

    def dual_limit(self, unit: float) -> float:
        """A bound on ``|X^T alpha / n|`` from its value ``unit`` for ``|alpha_i| <= 1``:
        times the loss's dual radius (inf for the squared loss, where only 0 stays 0)."""
        radius = get_loss(self.loss).dual_radius
        if radius == 1.0 or unit == 0.0:
            return unit
        return unit * radius

    def problem(self, request: Request, reply: Reply, b_before: np.ndarray) -> str | None:
        """Why ``reply`` breaks a bound (None: it does not); ``b_before`` is the task's image
        it starts from (0 after a restart)."""
        t = request.task
        R, n = float(self.row_norm[t]), int(self.n_train[t])
        if not R >= 0 or n < 1:
            return "no max-row-norm or n-train known for the task: its replies cannot be bounded"
        w_norm = float(np.linalg.norm(request.w))
        loss = get_loss(self.loss)
        loss_limit = float(loss.value_bound(R * w_norm)) * self.slack
        if not float(reply.loss_mean) <= loss_limit:
            return (f"loss-mean = {reply.loss_mean:.6g} above its bound {loss_limit:.6g} "
                    f"(the {loss.name} loss at margins |z| <= max-row-norm |w_t|)")
        size = float(np.linalg.norm(reply.d_b))
        limit = self.dual_limit(R * min(request.budget, n) / n)
        if not size <= limit * self.slack:
            return (f"|delta-b| = {size:.6g} above its bound {limit:.6g} (max-row-norm {R:g} "
                    f"x min(budget {request.budget}, n-train {n}) / n-train)")
        image = float(np.linalg.norm(b_before + reply.d_b))
        if self.robust and not image <= self.dual_limit(R) * self.slack:
            return (f"|b_t + delta-b| = {image:.6g} above max-row-norm {R:g} (b_t = X_t^T "
                    "alpha_t / n_t with every |alpha_ti| <= 1)")
        return None


@dataclass(frozen=True)
class Outcome:
    """What the server did with a reply: ``status`` one of ``applied``, ``stale`` (beyond
    tau), ``unknown`` (no such request in flight: a duplicate, expired or foreign reply) or
    ``invalid`` (malformed); ``gamma`` the factor applied (0 unless applied) and
    ``dual_change`` the dual's change it caused."""

    status: str
    task: int
    request_id: int
    staleness: int = 0
    gamma: float = 0.0
    dual_change: float = 0.0
    reason: str = ""


# ----------------------------------------------------------------------------- device


def conjugate_change(loss: Loss, alpha: np.ndarray, d_alpha: np.ndarray,
                     y: np.ndarray) -> float:
    """A task's change of its conjugate term by the whole step ``d_alpha``,
    ``(1/n) sum_i [D(y_i (alpha_i + d_alpha_i)) - D(y_i alpha_i)]`` (D of ``loss``); for the
    hinge, whose D is linear, ``(1/n) sum_i y_i d_alpha_i``.

    Applied scaled by g in [0, 1], the step changes the term by at least ``g`` times this
    (D is concave: the chord lies below it), exactly for g in {0, 1} and, for the hinge, for
    every g (module docstring, "Any loss").
    """
    if loss.name == "hinge":
        return hinge_conjugate_value(d_alpha, y)
    if alpha.shape[0] == 0:
        return 0.0
    before = y * alpha
    after = np.clip(y * (alpha + d_alpha), *loss.dual_domain)
    return float(np.mean(loss.dual(after) - loss.dual(before)))


class AsyncDevice:
    """The device half: one task's data, its dual variables and the commit protocol.

    Parameters
    ----------
    task : int
    X, y : ndarray
        Training rows (n, d) and labels in {-1, +1}.
    loss : str or Loss
        The loss its dual variables belong to (:data:`~fmtl_flower.core.losses.LOSSES`); a
        request for another loss is refused (a dual of one loss is never continued under
        another).
    """

    def __init__(self, task: int, X: np.ndarray, y: np.ndarray,
                 loss: str | Loss = "hinge") -> None:
        self.task = int(task)
        self.loss = get_loss(loss)
        self.X = np.ascontiguousarray(X, dtype=np.float64)
        self.y = np.asarray(y, dtype=np.float64)
        self.sqnorm = np.einsum("ij,ij->i", self.X, self.X)
        self.alpha = np.zeros(self.X.shape[0])
        self.committed_id = 0
        self.pending: tuple[int, np.ndarray] | None = None
        self.stable: tuple[int, np.ndarray] = (0, self.alpha.copy())

    def _keep_stable(self, keep_id: int) -> None:
        """The stable copy: the newest committed state not after ``keep_id``."""
        if 0 <= self.committed_id <= keep_id and self.stable[0] != self.committed_id:
            self.stable = (self.committed_id, self.alpha.copy())

    def commit(self, confirm_id: int, confirm_gamma: float, keep_id: int = 0) -> bool:
        """Commit the pending step if ``confirm_id`` names it (scaled by ``confirm_gamma``),
        else discard it; restart from alpha = 0 when the committed state is not the server's
        (until the server applies a reply of the restarted state, every reply says so: a
        rejected or lost one leaves the server's b_t as it was), unless the stable copy is
        the server's (it resumed from a checkpoint: the device goes back to it). Returns
        whether the state was kept."""
        self._keep_stable(keep_id)
        if self.pending is not None and self.pending[0] == confirm_id:
            a = self.y * (self.alpha + confirm_gamma * self.pending[1])
            self.alpha = self.y * np.clip(a, *self.loss.dual_domain)  # in by convexity; round-off
            self.committed_id = confirm_id
        self.pending = None
        if self.committed_id != confirm_id and self.stable[0] == confirm_id:
            self.alpha, self.committed_id = self.stable[1].copy(), confirm_id
        self._keep_stable(keep_id)
        if self.committed_id != confirm_id:
            # restart from alpha = 0, and keep saying so (committed -1: a state the server
            # does not know) until the server applies a reply of the restarted state
            self.alpha = np.zeros_like(self.alpha)
            self.committed_id = RESTARTED
            return False
        return True

    def handle(self, request: Request) -> Reply:
        """Commit, evaluate the loss at the request's w, run the local SDCA, keep the step
        pending and reply."""
        if request.loss != self.loss.name:
            raise ValueError(f"request for the {request.loss!r} loss reached task {self.task}'s "
                             f"device, whose dual variables are the {self.loss.name!r} loss's")
        state_ok = self.commit(request.confirm_id, request.confirm_gamma, request.keep_id)
        n, loss = self.X.shape[0], self.loss
        loss_mean = loss.mean_value(self.X, self.y, request.w)
        dual_mean = loss.dual_mean(self.alpha, self.y)
        order = coordinate_order(request.seed, self.task, request.count, n)
        if request.method == "cocoa":
            d_alpha, d_b, steps, _ = cocoa_local_update(
                self.X, self.y, self.alpha, request.w, m_tt=request.m_tt,
                sigma_prime=request.sigma_prime, theta=request.theta, max_steps=request.budget,
                order=order, sqnorm=self.sqnorm, loss=loss)
        elif request.method == "mocha":
            d_alpha, d_b = sdca_local_update(
                self.X, self.y, self.alpha, request.w, budget=request.budget, m_tt=request.m_tt,
                sigma_prime=request.sigma_prime, order=order, sqnorm=self.sqnorm, loss=loss)
            steps = request.budget
        else:
            raise ValueError(f"method must be one of {METHODS}, got {request.method!r}")
        self.pending = (request.request_id, d_alpha)
        return Reply(self.task, request.request_id, d_b,
                     conjugate_change(loss, self.alpha, d_alpha, self.y), loss_mean, dual_mean,
                     int(steps), state_ok)


# ----------------------------------------------------------------------------- server


@dataclass(frozen=True)
class Certificate:
    """``primal`` = P(W_eval) (the models the devices last evaluated their losses on, with
    the current K), ``dual`` = D(alpha) of the applied replies, ``gap`` = primal - dual."""

    primal: float
    dual: float
    gap: float

    @property
    def relative_gap(self) -> float:
        return self.gap / max(abs(self.primal), np.finfo(float).tiny)


class AsyncMOCHAServer:
    """The server half of barrier-free MOCHA (module docstring).

    Parameters
    ----------
    state : MOCHAServerState
        B, M, W (W = B M kept exact after every reply).
    budgets : ndarray of shape (m,), int
        Local SDCA steps per request of each task.
    concurrency : int
        The most requests in flight at once (K_c).
    tau : int or None
        Staleness bound: a reply more than ``tau`` applied replies behind is rejected. None:
        unbounded while the tasks are uncoupled; when an Omega-step couples them, ``tau``
        becomes ``concurrency``.
    gamma : float
        MOCHA's aggregation parameter in (0, 1]: the safeguard's largest factor, and
        sigma''s scale.
    safeguard : bool
        Scale each reply by :func:`safeguard_gamma` (True) or apply it with ``gamma``.
    seed : int
        The run seed (coordinate orders).
    method, theta : str, float
        The devices' local solver (:data:`METHODS`) and CoCoA's theta in (0, 1).
    bounds : ReplyBounds, optional
        The bounds each reply is checked against (None: none; the certificate's check of
        the pairs is always on). With ``bounds.robust``, outlier tasks are also decoupled
        (module docstring, "Decoupling").
    loss : str or Loss
        The run's loss (:data:`~fmtl_flower.core.losses.LOSSES`; ``bounds.loss`` must be
        the same).
    sigma_prime_rule : str
        One of :data:`SIGMA_PRIME_RULES` (``synchronous`` needs the safeguard).
    """

    def __init__(self, state: MOCHAServerState, budgets: np.ndarray, *, concurrency: int,
                 tau: int | None = None, gamma: float = 1.0, safeguard: bool = True,
                 seed: int = 0, method: str = "mocha", theta: float = 0.5,
                 bounds: ReplyBounds | None = None, loss: str | Loss = "hinge",
                 sigma_prime_rule: str = "stale-safe") -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.loss = get_loss(loss)
        if bounds is not None and get_loss(bounds.loss) is not self.loss:
            raise ValueError(f"the reply bounds are the {get_loss(bounds.loss).name} loss's, "
                             f"the server's loss is {self.loss.name}")
        if sigma_prime_rule not in SIGMA_PRIME_RULES:
            raise ValueError(f"sigma-prime-rule must be one of {SIGMA_PRIME_RULES}, got "
                             f"{sigma_prime_rule!r}")
        if sigma_prime_rule == "synchronous" and not safeguard:
            raise ValueError("sigma-prime-rule 'synchronous' needs the safeguard: without it "
                             "stale updates may lower the dual")
        self.sigma_prime_rule = sigma_prime_rule
        self.method, self.theta = method, float(theta)
        m = state.num_tasks
        self.state = state
        self.budgets = np.asarray(budgets, dtype=np.int64)
        if self.budgets.shape != (m,) or np.any(self.budgets < 0):
            raise ValueError(f"budgets must be {m} integers >= 0")
        if not 1 <= concurrency:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.concurrency = int(min(concurrency, m))
        self.tau = tau
        self.gamma = float(gamma)
        self.safeguard = bool(safeguard)
        self.seed = int(seed)
        self.version = 0
        self.next_id = 1
        self.in_flight: dict[int, Request] = {}
        self.confirm_id = np.zeros(m, dtype=np.int64)
        self.sent = np.zeros(m, dtype=np.int64)
        self.confirm_gamma = np.ones(m)
        self.keep_id = np.zeros(m, dtype=np.int64)  # confirm_id at the newest checkpoint
        self.conjugate = np.zeros(m)  # A_t of the applied replies
        # A_t is a lower bound (a step applied with 0 < g < 1 under a loss with a curved D)
        # until the task's next reply reports its exact value (module docstring, "Any loss")
        self.conjugate_low = np.zeros(m, dtype=bool)
        self.eval_W = np.zeros((state.dim, m))
        self.eval_loss = np.full(m, np.nan)
        self.counts = {APPLIED: 0, STALE: 0, UNKNOWN: 0, INVALID: 0, "expired": 0,
                       "resets": 0}
        self.bounds = bounds
        self.certificate_rejections = 0  # replies whose pair failed the certificate's check
        self.last_rejection: Outcome | None = None  # the newest reply rejected with a reason
        self.watch = OutlierWatch(m) if bounds is not None and bounds.robust else None
        self.last_step = np.zeros(m)  # |delta-b| of each task's applied replies since the check
        self.stepped = np.zeros(m, dtype=bool)  # tasks with an applied reply since the check
        self.decoupling_due = False  # outliers found while requests were in flight
        self.decoupled_log: list[tuple[int, list[int]]] = []  # (applied, newly decoupled)
        self._refresh_inverse()

    # --- the regulariser and sigma'
    def _refresh_inverse(self) -> None:
        if self.tau is None and np.any(coupling_max(self.state.M) > 0):
            self.tau = self.concurrency
        self.sigma_prime = async_sigma_prime(self.state.M, self.tau, self.concurrency,
                                             self.gamma)
        if self.sigma_prime_rule == "synchronous":
            self.sigma_prime = np.asarray(self.state.sigma_prime("global"), dtype=np.float64)
        self.m_diag = self.state.m_diag()
        self.K = self.state.formulation.regulariser_matrix()

    # --- sending
    def can_issue(self) -> bool:
        """Whether one more request may leave now: fewer than ``concurrency`` in flight, and
        (flow control) every request in flight can still be applied within ``tau`` even if
        all the others, and the new one, are applied first."""
        if len(self.in_flight) >= self.concurrency:
            return False
        if self.tau is None or not self.in_flight:
            return True
        oldest = min(r.version for r in self.in_flight.values())
        return self.version - oldest + len(self.in_flight) <= self.tau

    def issue(self, task: int) -> Request:
        """A new request for ``task`` (none of its own may be in flight)."""
        task = int(task)
        if task in self.in_flight:
            raise RuntimeError(f"task {task} already has request "
                               f"{self.in_flight[task].request_id} in flight")
        self.sent[task] += 1
        request = Request(task, self.next_id, int(self.sent[task]), self.version,
                          self.state.W[:, task].copy(),
                          float(self.m_diag[task]), float(self.sigma_prime[task]),
                          int(self.budgets[task]), self.seed, int(self.confirm_id[task]),
                          float(self.confirm_gamma[task]), self.method, self.theta,
                          int(self.keep_id[task]), self.loss.name)
        self.next_id += 1
        self.in_flight[task] = request
        return request

    def expire(self, task: int, request_id: int) -> bool:
        """Give up on a request (lost, or past its deadline): theta = 1. False if it was not
        in flight (already answered or expired)."""
        request = self.in_flight.get(int(task))
        if request is None or request.request_id != request_id:
            return False
        del self.in_flight[int(task)]
        self.counts["expired"] += 1
        return True

    def reject(self, task: int, request_id: int) -> Outcome | None:
        """A reply to a request in flight that could not be read (the trust boundary
        rejected it): the request ends as ``invalid`` (theta = 1). None if no such request
        is in flight."""
        request = self.in_flight.get(int(task))
        if request is None or request.request_id != request_id:
            return None
        del self.in_flight[request.task]
        return self._count(Outcome(INVALID, request.task, request.request_id,
                                   self.version - request.version))

    # --- receiving
    def receive(self, reply: Reply) -> Outcome:
        """Apply one reply at the current state (or reject it); never raises on its content."""
        request = self.in_flight.get(int(reply.task))
        if request is None or request.request_id != reply.request_id:
            return self._count(Outcome(UNKNOWN, int(reply.task), int(reply.request_id)))
        del self.in_flight[request.task]
        staleness = self.version - request.version
        if not self._well_formed(reply):
            return self._count(Outcome(INVALID, request.task, request.request_id, staleness))
        if self.tau is not None and staleness > self.tau:
            return self._count(Outcome(STALE, request.task, request.request_id, staleness))
        outcome = self._count(self._apply(request, reply, staleness))
        if outcome.status == APPLIED and self.watch is not None:
            self._watch_step(request.task, float(np.linalg.norm(reply.d_b)))
        return outcome

    def count_stray(self) -> None:
        """Count a reply that answers no request in flight and could not even be tied to a
        task (a transport's message-level drop: late, duplicate or foreign) as ``unknown``."""
        self.counts[UNKNOWN] += 1

    def _well_formed(self, reply: Reply) -> bool:
        d_b = np.asarray(reply.d_b)
        scalars = (reply.delta_dual, reply.loss_mean, reply.dual_mean)
        lo, hi = self.loss.dual_range  # the conjugate term's range bounds its change
        return (d_b.shape == (self.state.dim,) and bool(np.all(np.isfinite(d_b)))
                and all(math.isfinite(float(v)) for v in scalars)
                and abs(float(reply.delta_dual)) <= hi - lo and float(reply.loss_mean) >= 0.0)

    def _apply(self, request: Request, reply: Reply, staleness: int) -> Outcome:
        t = request.task
        dual_before = self.dual()
        saved = None
        if not reply.state_ok:  # the device restarted from alpha = 0: so does b_t
            saved = (self.state.B[:, t].copy(), self.state.W.copy(), float(self.conjugate[t]))
            self.state.reset_tasks(np.array([t]))
            self.conjugate[t] = 0.0
        conjugate_before = float(self.conjugate[t])
        if reply.state_ok and self.conjugate_low[t]:  # the exact value of the same alpha
            conjugate_before = max(conjugate_before, float(reply.dual_mean))
        d_b = np.asarray(reply.d_b, dtype=np.float64)
        ascent = float(reply.delta_dual) - float(self.state.W[:, t] @ d_b)
        curvature = float(self.m_diag[t] * (d_b @ d_b))
        g = safeguard_gamma(ascent, curvature, self.gamma) if self.safeguard else self.gamma
        reason = self._reply_problem(request, reply, g, self.state.B[:, t].copy(),
                                     conjugate_before)
        if reason is not None:
            if saved is not None:  # undo the reset: the reply changes nothing
                self.state.B[:, t], self.state.W, self.conjugate[t] = saved
            self.certificate_rejections += reason.startswith(REASON_PREFIX)
            self.last_rejection = Outcome(INVALID, t, request.request_id, staleness,
                                          reason=reason)
            return self.last_rejection
        self.counts["resets"] += saved is not None
        self.conjugate[t] = conjugate_before
        if g > 0.0:
            self.state.add_updates(np.array([t]), (g * d_b)[:, None])
            self.conjugate[t] += g * float(reply.delta_dual)
        # the chord g delta A_t is exact for the hinge's linear D and for g in {0, 1}
        self.conjugate_low[t] = self.loss.name != "hinge" and 0.0 < g < 1.0
        self.version += 1
        self.confirm_id[t] = request.request_id
        self.confirm_gamma[t] = g
        self.eval_W[:, t] = request.w
        self.eval_loss[t] = float(reply.loss_mean)
        return Outcome(APPLIED, t, request.request_id, staleness, g, self.dual() - dual_before)

    def _reply_problem(self, request: Request, reply: Reply, g: float, b_before: np.ndarray,
                       conjugate_before: float) -> str | None:
        """Why a reply must be rejected (module docstring, "Checks"), None if it passes: the
        bounds, then the certificate's check of the reported pair and of the pair after the
        update scaled by ``g``."""
        if self.bounds is not None:
            reason = self.bounds.problem(request, reply, b_before)
            if reason is not None:
                return reason
        w, d_b = request.w, np.asarray(reply.d_b, dtype=np.float64)
        loss = float(reply.loss_mean)
        problems = pair_problems(
            self.loss, np.array([loss, loss]),
            np.array([float(reply.dual_mean), conjugate_before + g * float(reply.delta_dual)]),
            np.array([float(w @ b_before), float(w @ (b_before + g * d_b))]))
        if not problems:
            return None
        which, reason = min(problems.items())
        return reason + ("" if which == 0 else " (the pair after the update)")

    def _count(self, outcome: Outcome) -> Outcome:
        self.counts[outcome.status] += 1
        return outcome

    # --- decoupling (robust mode)
    def _watch_step(self, task: int, size: float) -> None:
        """Note an applied reply's |delta-b| (the largest since the last check) and check the
        federation for outliers once every m replies (a round of work)."""
        self.last_step[task] = max(self.last_step[task], size)
        self.stepped[task] = True
        if self.counts[APPLIED] % self.state.num_tasks == 0:
            self.check_outliers()

    def check_outliers(self) -> np.ndarray:
        """Robust mode: feed the round of work's statistics to the
        :class:`~fmtl_flower.core.decoupling.OutlierWatch` (as synchronous MOCHA's
        ``_decouple_outliers``: each task's largest |delta-b| over its bound
        ``scale min(budget, n) / n``, |b_t|, B and, for a learned Omega, the coupling
        weights), then decouple the new outliers now, or at the next drain when the safeguard
        is off and requests are in flight (module docstring, "Decoupling"). Returns the newly
        found outliers (bool, (m,))."""
        assert self.watch is not None and self.bounds is not None
        scale = federation_scale(self.bounds.row_norm)
        n = np.maximum(self.bounds.n_train, 1)
        coupling = None if self.state.formulation.fixed else coupling_weights(self.state.M)
        new = self.watch.update(self.last_step, scale * np.minimum(self.budgets, n) / n,
                                np.linalg.norm(self.state.B, axis=0), scale, self.stepped,
                                images=self.state.B, coupling=coupling)
        self.last_step[:] = 0.0
        self.stepped[:] = False
        if new.any():
            self.decoupling_due = True
            if self.safeguard or not self.in_flight:
                self._decouple()
        return new

    def _decouple(self) -> None:
        """Decouple the watch's outliers (M -> M', W <- B M'), then sigma' and K; logged."""
        assert self.watch is not None
        decoupled = self.watch.decoupled
        was = np.zeros_like(decoupled) if self.state.decoupled is None else self.state.decoupled
        new = np.flatnonzero(decoupled & ~was).tolist()
        self.state.decouple(decoupled)
        self._refresh_inverse()
        self.decoupling_due = False
        self.decoupled_log.append((self.counts[APPLIED], new))
        LOGGER.warning("async MOCHA: task%s %s decoupled from the others after %d applied "
                       "replies (off-diagonal coupling in M set to 0 for the rest of the run): "
                       "their updates are outliers against the federation's (robust mode)",
                       "s" if len(new) > 1 else "", new[:20], self.counts[APPLIED])

    @property
    def decoupled(self) -> np.ndarray:
        """The tasks decoupled so far (bool, (m,))."""
        m = self.state.num_tasks
        return np.zeros(m, dtype=bool) if self.state.decoupled is None \
            else self.state.decoupled.copy()

    # --- objectives
    def dual(self) -> float:
        """D(alpha) = sum_t A_t - (1/2) tr(B M B^T) of the applied replies."""
        return float(self.conjugate.sum()) - self.state.regulariser()

    def certificate(self) -> Certificate | None:
        """The certified gap (module docstring); None until every task has evaluated once."""
        if np.any(np.isnan(self.eval_loss)):
            return None
        reg = 0.5 * float(np.einsum("ij,ij->", self.eval_W @ self.K, self.eval_W))
        primal = float(self.eval_loss.sum()) + reg
        dual = self.dual()
        return Certificate(primal, dual, primal - dual)

    # --- checkpoints
    def state_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Everything needed to continue bit for bit (``(arrays, JSON meta)``): MOCHA's
        state (B, W, M, the formulation's arrays), the per-task bookkeeping, the requests in
        flight and the counts. Marks the current ``confirm_id`` as the checkpoint's
        (``keep_id``): call it only for a checkpoint that is written."""
        self.keep_id = self.confirm_id.copy()
        flight = [self.in_flight[t] for t in sorted(self.in_flight)]
        arrays = {**{f"state.{k}": v for k, v in self.state.state_arrays().items()},
                  "confirm_id": self.confirm_id, "confirm_gamma": self.confirm_gamma,
                  "sent": self.sent, "keep_id": self.keep_id, "conjugate": self.conjugate,
                  "conjugate_low": self.conjugate_low, "decoupled": self.decoupled,
                  "last_step": self.last_step, "stepped": self.stepped,
                  **(self.watch.state_arrays() if self.watch is not None else {}),
                  "eval_W": self.eval_W, "eval_loss": self.eval_loss,
                  "flight.ints": np.array([[r.task, r.request_id, r.count, r.version, r.budget,
                                            r.confirm_id] for r in flight],
                                          dtype=np.int64).reshape(-1, 6),
                  "flight.floats": np.array([[r.m_tt, r.sigma_prime, r.confirm_gamma]
                                             for r in flight]).reshape(-1, 3),
                  "flight.w": np.array([r.w for r in flight]).reshape(-1, self.state.dim)}
        meta = {"version": self.version, "next_id": self.next_id, "tau": self.tau,
                "counts": self.counts, "certificate_rejections": self.certificate_rejections,
                "decoupling_due": self.decoupling_due}
        return arrays, meta

    def restore(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Load :meth:`state_arrays`' output into this server (built with the same
        settings and an empty state of the same shapes)."""
        state = MOCHAServerState.from_state_arrays(
            {k[len("state."):]: v for k, v in arrays.items() if k.startswith("state.")},
            self.state.formulation)
        m = state.num_tasks
        for key, shape in (("confirm_id", (m,)), ("eval_W", (state.dim, m)),
                           ("eval_loss", (m,)), ("conjugate", (m,))):
            if arrays[key].shape != shape:
                raise ValueError(f"checkpoint {key!r} has shape {arrays[key].shape}, "
                                 f"expected {shape}")
        self.state = state
        for key in ("confirm_id", "sent", "keep_id"):
            setattr(self, key, np.array(arrays[key], dtype=np.int64))
        for key in ("confirm_gamma", "conjugate", "eval_W", "eval_loss"):
            setattr(self, key, np.array(arrays[key], dtype=np.float64))
        self._restore_robust(arrays, meta)
        self.version, self.next_id = int(meta["version"]), int(meta["next_id"])
        self.tau = meta["tau"]
        self.counts = {k: int(v) for k, v in meta["counts"].items()}
        self.certificate_rejections = int(meta["certificate_rejections"])
        self.in_flight = {}
        for ints, floats, w in zip(arrays["flight.ints"], arrays["flight.floats"],
                                   arrays["flight.w"], strict=True):
            task, request_id, count, version, budget, confirm_id = (int(v) for v in ints)
            self.in_flight[task] = Request(
                task, request_id, count, version, np.array(w), float(floats[0]),
                float(floats[1]), budget, self.seed, confirm_id, float(floats[2]),
                self.method, self.theta, int(self.keep_id[task]), self.loss.name)
        self._refresh_inverse()

    def _restore_robust(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """The lower-bound flags and the decoupling state of a checkpoint (absent from one
        written before them: nothing low, nothing decoupled); M stored is already M'."""
        m = self.state.num_tasks
        self.conjugate_low = np.array(arrays.get("conjugate_low", np.zeros(m)), dtype=bool)
        self.last_step = np.array(arrays.get("last_step", np.zeros(m)), dtype=np.float64)
        self.stepped = np.array(arrays.get("stepped", np.zeros(m)), dtype=bool)
        self.decoupling_due = bool(meta.get("decoupling_due", False))
        decoupled = np.array(arrays.get("decoupled", np.zeros(m)), dtype=bool)
        if decoupled.any():
            self.state.decoupled = decoupled
        if self.watch is not None:
            self.watch.restore(arrays)

    # --- Omega
    def omega_step(self) -> None:
        """Omega-step (only with nothing in flight: drain first), then sigma' and K."""
        if self.in_flight:
            raise RuntimeError(f"{len(self.in_flight)} requests in flight: drain before the "
                               "Omega-step")
        if self.decoupling_due:
            self._decouple()
        self.state.omega_step()
        self._refresh_inverse()


# ----------------------------------------------------------------------------- simulation


@dataclass
class Run:
    """The result of a simulation: the server (the state, for a synchronous run), the
    devices, one record per event that
    changed the state (``time_s``, ``applied``, ``status``, ``task``, ``staleness``, ``gamma``,
    ``dual``, and ``primal``, ``gap`` once certified) and the final virtual time."""

    server: Any
    devices: list[AsyncDevice]
    records: list[dict[str, Any]] = field(default_factory=list)
    virtual_time_s: float = 0.0
    alphas: list[np.ndarray] | None = None

    def dual_variables(self) -> list[np.ndarray]:
        """Each task's committed dual variables (the devices', or the synchronous run's)."""
        return self.alphas if self.alphas is not None else [d.alpha for d in self.devices]

    def time_to_gap(self, relative_gap: float) -> float | None:
        """Virtual time of the first record whose certified relative gap is <= the target."""
        for r in self.records:
            if r.get("gap") is not None and r["gap"] <= relative_gap * abs(r["primal"]):
                return r["time_s"]
        return None


def _formulation(tasks: Sequence[TaskArrays], formulation: Formulation | None, lam: float,
                 omega: str, options: dict[str, Any]) -> Formulation:
    return formulation if formulation is not None else make_formulation(
        omega, len(tasks), lam=lam, **options)


def _budgets(tasks: Sequence[TaskArrays], local_frac: float) -> np.ndarray:
    n = np.array([X.shape[0] for X, _ in tasks], dtype=np.int64)
    return np.maximum(np.floor(local_frac * n), 1).astype(np.int64)


class _Clock:
    """The virtual clock's event queue: (time, sequence, kind, payload), in that order (a
    unique counter after the sequence keeps payloads from ever being compared)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int, int, str, Any]] = []
        self.seq = 0
        self.now = 0.0
        self._unique = 0

    def at(self, time_s: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (time_s, self.seq, self._unique, kind, payload))
        self.seq += 1
        self._unique += 1

    def next(self) -> tuple[str, Any]:
        self.now, _, _, kind, payload = heapq.heappop(self.events)
        return kind, payload


def simulate_async_mocha(
    tasks: Sequence[TaskArrays],
    seconds: np.ndarray,
    *,
    lam: float = 0.1,
    omega: str = "identity",
    formulation: Formulation | None = None,
    formulation_options: dict[str, Any] | None = None,
    replies: int,
    concurrency: int | None = None,
    tau: int | None = None,
    latency_sigma: float = 0.0,
    gamma: float = 1.0,
    safeguard: bool = True,
    local_frac: float = 1.0,
    omega_every: int = 0,
    seed: int = 0,
    deliver: Callable[[Request, Reply], Sequence[Reply | Rejected]] | None = None,
    timeout_s: float | None = None,
    stop_relative_gap: float | None = None,
    on_event: Callable[[Run, dict[str, Any]], None] | None = None,
    method: str = "mocha",
    theta: float = 0.5,
    robust: bool = True,
    loss: str = "hinge",
    latency_persistence: float = 0.0,
    availability: Availability | None = None,
    sigma_prime_rule: str = "stale-safe",
) -> Run:
    """Run barrier-free MOCHA on a virtual clock until ``replies`` replies are applied.

    Parameters
    ----------
    tasks : sequence of (X, y)
        Each task's training data (one device each).
    seconds : ndarray of shape (m,)
        Eq. (30)'s time of one request of each task (before the latency factor).
    lam, omega, formulation, formulation_options
        The regulariser, as for :func:`fmtl_flower.centralized.fit_mocha`.
    replies : int
        Applied replies to run (``rounds x m`` for the work of ``rounds`` synchronous rounds);
        the run also ends after ``10 x replies + m`` requests (e.g. a timeout shorter than
        every request).
    concurrency, tau, gamma, safeguard, sigma_prime_rule
        See :class:`AsyncMOCHAServer` (``concurrency`` None: every task).
    latency_sigma, latency_persistence : float
        sigma of the log-normal latency factor (0: deterministic) and the share of its
        log-variance that is per device (:func:`latency_factor`; 0: every request drawn
        independently).
    availability : Availability, optional
        Offline windows of the devices (None: always online).
    local_frac : float
        Local steps per request as a fraction of n_t.
    omega_every : int
        An Omega-step every ``omega_every x m`` applied replies (0: never), after draining.
    deliver : callable, optional
        ``deliver(request, reply) -> replies`` decides what reaches the server (tests: lose,
        duplicate, tamper); each delivered reply arrives at the request's finish time, in
        order. By default the reply itself.
    timeout_s : float, optional
        A request still unanswered this long after it left expires (theta = 1). Default:
        10 times the slowest nominal request time.
    stop_relative_gap : float, optional
        Stop early once the certified relative gap is at most this.
    on_event : callable, optional
        Called with the run (server and devices) and each new record.
    method, theta : str, float
        ``mocha`` (SDCA for the budget) or ``cocoa`` (the CoCoA baseline: SDCA until the local
        gap falls by ``theta``).
    robust : bool
        Check the replies against the tasks' true bounds (:meth:`ReplyBounds.of_tasks`) with
        the dual-image bound and decouple outlier tasks (True) or without them; the
        certificate's check is always on.
    loss : str
        The loss (:data:`~fmtl_flower.core.losses.LOSSES`).
    """
    m = len(tasks)
    seconds = np.broadcast_to(np.asarray(seconds, dtype=np.float64), (m,))
    state = MOCHAServerState.zeros(tasks[0][0].shape[1], _formulation(
        tasks, formulation, lam, omega, formulation_options or {}))
    server = AsyncMOCHAServer(state, _budgets(tasks, local_frac),
                              concurrency=m if concurrency is None else concurrency, tau=tau,
                              gamma=gamma, safeguard=safeguard, seed=seed, method=method,
                              theta=theta, bounds=ReplyBounds.of_tasks(tasks, robust, loss),
                              loss=loss, sigma_prime_rule=sigma_prime_rule)
    devices = [AsyncDevice(t, X, y, loss) for t, (X, y) in enumerate(tasks)]

    def transport(request: Request) -> list[Reply | Rejected]:
        reply = devices[request.task].handle(request)
        return [reply] if deliver is None else list(deliver(request, reply))

    return run_protocol(Run(server, devices), seconds, transport, replies=replies,
                        latency_sigma=latency_sigma, seed=seed, omega_every=omega_every,
                        timeout_s=timeout_s, stop_relative_gap=stop_relative_gap,
                        on_event=on_event, latency_persistence=latency_persistence,
                        availability=availability)


@dataclass(frozen=True)
class Rejected:
    """What a transport delivers for a reply it could not read (the trust boundary rejected
    it): the server counts it ``invalid`` (theta = 1)."""

    task: int
    request_id: int


#: ``transport(request) -> deliveries``: sends one request and returns what will reach the
#: server at the request's virtual finish time, in order (a reply, a rejection, copies, or
#: nothing for a lost one).
Transport = Callable[[Request], Sequence["Reply | Rejected"]]


def run_protocol(run: Run, seconds: np.ndarray, transport: Transport, *, replies: int,
                 latency_sigma: float = 0.0, seed: int = 0, omega_every: int = 0,
                 timeout_s: float | None = None, stop_relative_gap: float | None = None,
                 on_event: Callable[[Run, dict[str, Any]], None] | None = None,
                 latency_persistence: float = 0.0,
                 availability: Availability | None = None) -> Run:
    """The protocol's event loop on the virtual clock, for any transport.

    :func:`simulate_async_mocha` calls the devices directly; the Flower strategy
    (:mod:`fmtl_flower.strategies.async_mocha`) sends messages through a Grid. Both give the
    same records for the same seed. Arguments as for :func:`simulate_async_mocha`; ``run``
    holds the server (and, for checks, the devices) and receives the records.
    """
    loop = EventLoop(run, seconds, transport, latency_sigma=latency_sigma, seed=seed,
                     omega_every=omega_every, timeout_s=timeout_s,
                     latency_persistence=latency_persistence, availability=availability)
    return loop.run(replies, stop_relative_gap=stop_relative_gap, on_event=on_event)


class EventLoop:
    """The protocol's event loop on the virtual clock (:func:`run_protocol`), with its state
    (the clock's queue, the idle tasks, the drain before an Omega-step) kept between events so
    that it can be checkpointed after any event and resumed (:meth:`state_arrays`,
    :meth:`restore`): the requests in flight are re-issued, unchanged, at their original
    virtual times, so a device that kept its state (or went back to its stable copy) replies
    the same and the resumed run continues bit for bit."""

    def __init__(self, run: Run, seconds: np.ndarray, transport: Transport, *,
                 latency_sigma: float = 0.0, seed: int = 0, omega_every: int = 0,
                 timeout_s: float | None = None, latency_persistence: float = 0.0,
                 availability: Availability | None = None) -> None:
        self.run_, self.transport = run, transport
        self.server = server = run.server
        m = server.state.num_tasks
        self.seconds = np.broadcast_to(np.asarray(seconds, dtype=np.float64), (m,))
        self.timeout = 10.0 * float(self.seconds.max()) if timeout_s is None \
            else float(timeout_s)
        self.latency_sigma, self.seed = latency_sigma, seed
        self.latency_persistence = latency_persistence
        latency_factor(seed, 0, 1, latency_sigma, latency_persistence)  # checks both
        self.availability = None if availability is None else availability.schedule(seed, m)
        self.offline: set[int] = set()  # idle tasks waiting for their device to be online
        self.clock, self.idle = _Clock(), deque(range(m))
        self.omega_due = omega_every * m if omega_every > 0 else 0
        self.draining = False
        self.issued: dict[int, tuple[float, int]] = {}  # request id -> (time sent, first seq)
        self._reissue: list[Request] = []  # restored requests in flight, re-issued by run()

    def push(self, task: int) -> None:
        """Issue a request to ``task`` now and queue what it delivers and its expiry."""
        request = self.server.issue(task)
        self.issued[request.request_id] = (self.clock.now, self.clock.seq)
        self._queue(request, self.clock.now)

    def _queue(self, request: Request, sent: float) -> None:
        """Queue what ``request`` (sent at ``sent``) delivers and its expiry: at the
        timeout, or when its device goes offline before the reply is sent (it is lost)."""
        duration = self.seconds[request.task] * latency_factor(
            self.seed, request.task, request.count, self.latency_sigma,
            self.latency_persistence)
        deliveries = self.transport(request)
        offline_at = _offline_at(self.availability, request.task, sent)
        if sent + duration <= offline_at:
            for delivery in deliveries:
                self.clock.at(sent + duration, "reply", delivery)
        self.clock.at(min(sent + self.timeout, offline_at), "expire",
                      (request.task, request.request_id))

    def fill(self) -> None:
        """Send work to idle tasks while the server may issue (not while draining); an
        idle task whose device is offline waits for an ``online`` event instead."""
        while not self.draining and self.idle and self.server.can_issue():
            task = self.idle.popleft()
            wake = self.clock.now if self.availability is None else \
                self.availability.next_online(task, self.clock.now)
            if wake <= self.clock.now:
                self.push(task)
            else:
                self.offline.add(task)
                self.clock.at(wake, "online", task)

    def run(self, replies: int, *, stop_relative_gap: float | None = None,
            on_event: Callable[[Run, dict[str, Any]], None] | None = None,
            after_event: Callable[[EventLoop, dict[str, Any]], None] | None = None) -> Run:
        """Process events until ``replies`` replies are applied (module docstring);
        ``after_event(loop, record)`` is called once each event is done (new work sent):
        where a checkpoint may be taken."""
        server, run, m = self.server, self.run_, self.server.state.num_tasks
        if server.counts[APPLIED] < replies:
            self._requeue()
        self.fill()
        max_requests = 10 * replies + m  # a time-out that no request ever meets must end too
        while self.clock.events and server.counts[APPLIED] < replies \
                and server.next_id <= max_requests:
            kind, payload = self.clock.next()
            if kind == "online":
                self.offline.discard(payload)
                self.idle.append(payload)
                self.fill()
                continue
            if kind == "expire":
                outcome = Outcome("expired", *payload) if server.expire(*payload) else None
            elif isinstance(payload, Rejected):
                outcome = server.reject(payload.task, payload.request_id)
            else:
                outcome = server.receive(payload)
            if outcome is not None and outcome.status == UNKNOWN:
                log_unknown(outcome)
            if outcome is None or outcome.status == UNKNOWN:
                continue
            self.issued.pop(outcome.request_id, None)
            self.idle.append(outcome.task)
            record = event_record(server, self.clock.now, outcome)
            run.records.append(record)
            if on_event is not None:
                on_event(run, record)
            if stop_relative_gap is not None and record.get("gap") is not None \
                    and record["gap"] <= stop_relative_gap * abs(record["primal"]):
                break
            advance_omega(self, outcome, replies)
            self.fill()
            if after_event is not None:
                after_event(self, record)
        run.virtual_time_s = self.clock.now
        return run

    # --- checkpoints
    def state_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The server's state and the loop's (``(arrays, JSON meta)``), after an event."""
        arrays, meta = self.server.state_arrays()
        flight = sorted(r.request_id for r in self.server.in_flight.values())
        arrays["flight.sent"] = np.array([self.issued[i][0] for i in flight])
        arrays["flight.seq"] = np.array([self.issued[i][1] for i in flight], dtype=np.int64)
        meta.update(now=self.clock.now, seq=self.clock.seq,
                    idle=list(self.idle) + sorted(self.offline),
                    draining=self.draining, records=self.run_.records)
        return arrays, meta

    def restore(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Continue from :meth:`state_arrays`' output: the server's state, the records, and
        the requests in flight re-issued through the transport with their original send
        times and queue order (the events of requests no longer in flight are dropped:
        late duplicates and expiries of answered requests change nothing)."""
        self.server.restore(arrays, meta)
        self.run_.records = [dict(r) for r in meta["records"]]
        self.idle = deque(int(t) for t in meta["idle"])
        self.draining = bool(meta["draining"])
        self.clock = _Clock()
        self.clock.now = float(meta["now"])
        self._reissue = sorted(self.server.in_flight.values(), key=lambda r: r.request_id)
        for sent, seq, request in zip(arrays["flight.sent"], arrays["flight.seq"],
                                      self._reissue, strict=True):
            self.issued[request.request_id] = (float(sent), int(seq))
        self.clock.seq = int(meta["seq"])

    def _requeue(self) -> None:
        """Re-issue the restored requests in flight (once, when the run goes on)."""
        end = self.clock.seq
        for request in self._reissue:
            sent, self.clock.seq = self.issued[request.request_id]  # the original order
            self._queue(request, sent)
        self.clock.seq = max(self.clock.seq, end)
        self._reissue = []


def log_unknown(outcome: Outcome) -> None:
    """Log a reply that answers no request in flight (late after its request expired, a
    duplicate, or foreign): dropped, counted ``unknown``, the state unchanged."""
    LOGGER.warning("async MOCHA: reply of task %d to request %d answers no request in flight "
                   "(late after its expiry, a duplicate, or foreign); dropped", outcome.task,
                   outcome.request_id)


def _offline_at(schedule: AvailabilitySchedule | None, task: int, time_s: float) -> float:
    """When device ``task``, given work at ``time_s``, goes offline: inf if never (no
    schedule), ``time_s`` if it is offline already."""
    if schedule is None:
        return math.inf
    until = schedule.online_until(task, time_s)
    return time_s if until is None else until


def advance_omega(loop: Any, outcome: Outcome, replies: int) -> None:
    """The Omega-step schedule of an event loop (virtual clock or wall clock) after
    ``outcome``: every ``loop.omega_due`` applied replies (before the last of ``replies``)
    the loop stops issuing (``loop.draining``), and once nothing is in flight the server
    takes the Omega-step and issuing resumes."""
    server = loop.server
    applied = server.counts[APPLIED]
    if loop.omega_due and outcome.status == APPLIED and applied % loop.omega_due == 0 \
            and applied < replies:
        loop.draining = True
    if loop.draining and not server.in_flight:
        server.omega_step()
        loop.draining = False


def event_record(server: AsyncMOCHAServer, time_s: float, outcome: Outcome) -> dict[str, Any]:
    """The record of one event (an applied, rejected or expired request) at ``time_s``."""
    cert = server.certificate()
    applied = server.counts[APPLIED]
    return {"time_s": time_s, "applied": applied, "round": applied // server.state.num_tasks,
            "status": outcome.status,
            "task": outcome.task, "staleness": outcome.staleness, "gamma": outcome.gamma,
            "dual": server.dual(), "primal": None if cert is None else cert.primal,
            "gap": None if cert is None else cert.gap}


# ----------------------------------------------------------------------------- synchronous


def steps_by_deadline(budget: int, seconds: float, deadline: float | None,
                      comm_s: float) -> int:
    """Steps a device that needs ``seconds`` for ``budget`` steps (``comm_s`` of it
    communication, scaled alike) completes within ``deadline``: all of them without a
    deadline, 0 when even its communication misses it (it cannot reply: dropped)."""
    if deadline is None or seconds <= deadline:
        return int(budget)
    compute = seconds - comm_s
    if comm_s >= deadline or compute <= 0:
        return 0
    return int(math.floor(budget * (deadline - comm_s) / compute))


def sync_round_plan(budgets: np.ndarray, seconds: np.ndarray, comm_seconds: np.ndarray,
                    deadline: float | None, start: float,
                    schedule: AvailabilitySchedule | None = None) -> tuple[np.ndarray, float]:
    """One synchronous round that starts at ``start``: the steps each device's applied
    update makes (0: it is not applied) and the round's length.

    ``seconds`` / ``comm_seconds``: each device's time this round (after its latency
    factor). A device offline at ``start`` gets no work and is not waited for; one cut to
    the deadline replies at it (:func:`steps_by_deadline`); one dropped (0 steps fit) holds
    the round until the deadline (the server cannot tell it from a slow one); one that goes
    offline before its reply is sent loses it, and holds the round until it disconnects or
    the deadline.
    """
    steps = np.zeros(len(budgets), dtype=np.int64)
    longest = 0.0
    for t, budget in enumerate(budgets):
        offline_at = _offline_at(schedule, t, start) - start
        if offline_at <= 0.0:
            continue
        fit = steps_by_deadline(int(budget), float(seconds[t]), deadline, float(comm_seconds[t]))
        reply = seconds[t] if deadline is None else min(seconds[t], deadline) if fit \
            else deadline
        if reply > offline_at:  # lost when the device disconnects
            reply, fit = offline_at if deadline is None else min(offline_at, deadline), 0
        steps[t] = fit
        longest = max(longest, float(reply))
    return steps, longest


def simulate_sync_mocha(
    tasks: Sequence[TaskArrays],
    seconds: np.ndarray,
    comm_seconds: np.ndarray,
    *,
    lam: float = 0.1,
    omega: str = "identity",
    formulation_options: dict[str, Any] | None = None,
    rounds: int,
    deadline: float | None = None,
    latency_sigma: float = 0.0,
    gamma: float = 1.0,
    sigma_mode: str = "global",
    local_frac: float = 1.0,
    seed: int = 0,
    stop_relative_gap: float | None = None,
    latency_persistence: float = 0.0,
    availability: Availability | None = None,
    max_time_s: float | None = None,
    loss: str | Loss = "hinge",
) -> Run:
    """Synchronous MOCHA (fixed Omega) on the same virtual clock and latency draws, with the
    same ``loss`` as the asynchronous run it is compared with.

    Round k: task t's device would need ``seconds[t] x latency_factor(seed, t, k)``; with a
    ``deadline`` it does the steps that fit (:func:`steps_by_deadline`; 0 fitting: dropped)
    and the round lasts ``min(deadline, slowest reply)`` (until the deadline if any device
    is dropped: the server cannot tell it from a slow one). Updates are applied together
    with Lemma 9's sigma' (``sigma_mode``). Certificate as the asynchronous one: the primal
    at the models the devices evaluated their losses on (each round's start models, kept
    for a dropped device from its last round), the dual after the round. With
    ``availability``, a round trains the devices online when it starts
    (:func:`sync_round_plan`); while none is, the clock waits for the first to come back.
    The run ends after ``rounds`` rounds, at ``stop_relative_gap``, or after the first round
    that ends past ``max_time_s`` virtual seconds.
    """
    m = len(tasks)
    loss = get_loss(loss)
    seconds = np.broadcast_to(np.asarray(seconds, dtype=np.float64), (m,))
    comm_seconds = np.broadcast_to(np.asarray(comm_seconds, dtype=np.float64), (m,))
    state = MOCHAServerState.zeros(tasks[0][0].shape[1], make_formulation(
        omega, m, lam=lam, gamma=gamma, **(formulation_options or {})))
    budgets = _budgets(tasks, local_frac)
    alphas = [np.zeros(X.shape[0]) for X, _ in tasks]
    sqnorms = [np.einsum("ij,ij->i", X, X) for X, _ in tasks]
    eval_W, eval_loss = np.zeros((state.dim, m)), np.full(m, np.nan)
    K, m_diag, sigma_p = (state.formulation.regulariser_matrix(), state.m_diag(),
                          state.sigma_prime(sigma_mode))
    run, now = Run(state, [], alphas=alphas), 0.0
    schedule = None if availability is None else availability.schedule(seed, m)
    for k in range(1, rounds + 1):
        if schedule is not None:  # nobody online: wait for the first device to come back
            now = min(schedule.next_online(t, now) for t in range(m))
        factors = [latency_factor(seed, t, k, latency_sigma, latency_persistence)
                   for t in range(m)]
        plan, longest = sync_round_plan(budgets, seconds * factors, comm_seconds * factors,
                                        deadline, now, schedule)
        delta_B = np.zeros((state.dim, m))
        for t, (X, y) in enumerate(tasks):
            steps = int(plan[t])
            if steps == 0:
                continue
            eval_W[:, t] = state.W[:, t]
            eval_loss[t] = loss.mean_value(X, y, state.W[:, t])
            d_alpha, d_b = sdca_local_update(
                X, y, alphas[t], state.W[:, t].copy(), budget=steps, m_tt=float(m_diag[t]),
                sigma_prime=float(sigma_p[t]), order=coordinate_order(seed, t, k, X.shape[0]),
                sqnorm=sqnorms[t], loss=loss)
            alphas[t] += gamma * d_alpha
            delta_B[:, t] = gamma * d_b
        state.add_updates(np.arange(m), delta_B)
        now += longest
        dual = sum(loss.dual_mean(a, y) for a, (_, y) in zip(alphas, tasks, strict=True)) \
            - state.regulariser()
        record = {"time_s": now, "applied": k * m, "round": k, "dual": dual,
                  "primal": None, "gap": None}
        if not np.any(np.isnan(eval_loss)):
            primal = float(eval_loss.sum()) + 0.5 * float(np.einsum("ij,ij->", eval_W @ K, eval_W))
            record.update(primal=primal, gap=primal - dual)
        run.records.append(record)
        if stop_relative_gap is not None and record["gap"] is not None \
                and record["gap"] <= stop_relative_gap * abs(record["primal"]):
            break
        if max_time_s is not None and now > max_time_s:
            break
    run.virtual_time_s = now
    return run
