"""Barrier-free MOCHA (issue 28) as a Flower ``Strategy``, on a virtual clock.

The protocol, its guarantees and their proofs are in :mod:`fmtl_flower.core.async_mocha` and
``docs/guides/async-mocha.md``. This module carries it over Flower's Message API: each request
is one ``train`` message pushed to the task's node (``Grid.push_messages``), its reply is
pulled (``Grid.pull_messages``) and read through the trust boundary
(:class:`~fmtl_flower.strategies.trust.ReplyBoundary`: anything wrong with a reply is a logged
rejection, theta = 1, never an exception), and the event loop of
:class:`~fmtl_flower.core.async_mocha.EventLoop` applies the replies in the order of their
virtual finish times. So for the same seed the records equal those of
:func:`~fmtl_flower.core.async_mocha.simulate_async_mocha` (a test checks it in-process).

Wire contract
-------------
query ``whoami``: as MOCHA's (:mod:`fmtl_flower.strategies.mocha`): ConfigRecord ``info``
    with ``task-id``, ``n-train``, ``n-test``, ``dim``, ``max-row-norm``.

``train`` (server -> node): arrays ``w`` float64 (d,), the task's model at the current
    version; config ``task-id`` int, ``request-id`` int >= 1 (unique in the run), ``count``
    int >= 1 (the task's request number; keys the coordinate order), ``m-tt`` float > 0,
    ``sigma-prime`` float > 0, ``budget`` int >= 0, ``seed`` int, ``confirm-id`` int >= 0
    (the task's newest request whose reply was applied, 0: none), ``confirm-gamma`` float
    in [0, 1] (the factor it was applied with), ``method`` str (``mocha``: SDCA for the
    budget; ``cocoa``: until the local gap falls by ``theta`` float, at most the budget),
    ``keep-id`` int >= 0 (the task's ``confirm-id`` at the server's newest checkpoint, 0:
    none; the device keeps its newest committed state not after it, its stable copy, and
    goes back to it when a ``confirm-id`` names it: the server resumed from the checkpoint),
    ``run-token`` str (the run's identity, :meth:`AsyncMOCHA.run_identity`: the device's state
    and state file are bound to it; kept in checkpoints),
    optional ``loss`` str (sent when the run's loss is not ``hinge``), optional ``classes``
    and ``intercept-scaling`` (the run's lifting, as synchronous MOCHA's:
    :mod:`fmtl_flower.strategies.mocha`, "Multi-class and intercept"; ``d`` is then the
    lifted dimension). Reply: arrays ``delta-b`` float64 (d,); metrics
    ``task-id``, ``request-id``, ``delta-dual-mean`` (the change of the conjugate term by
    the whole step, |.| <= the width of the loss's dual range: 1 for the hinge),
    ``loss-mean`` (>= 0, at the w received), ``dual-mean`` (in the loss's dual range, [0, 1]
    for the hinge, after the commit), ``steps`` (int), ``state-ok`` (0/1).

Every reply is validated (keys, dtypes, shapes, finite values, matching task and request)
at the trust boundary; its numbers are then checked by the server as it applies the reply
(:class:`~fmtl_flower.core.async_mocha.ReplyBounds` and the certificate's check of
:class:`~fmtl_flower.core.async_mocha.AsyncMOCHAServer`, as synchronous MOCHA's,
:mod:`fmtl_flower.strategies.mocha`): ``loss-mean <= l-bound(R_t |w_t|)`` (1 + R_t |w_t|
for the hinge), ``|delta-b| <= R_t min(budget, n_t) / n_t``, in robust mode
``|b_t + delta-b| <= R_t`` (neither for the squared loss, whose dual is unbounded), and
``loss-mean - dual-mean + w_t . b_t >= 0`` for the reported pair and for the pair after the
update (so every certified gap is >= 0). A reply that fails is ``invalid`` (theta = 1), logged
with its reason; ``final`` counts the certificate's rejections
(``certificate_rejections_total``).

Robust mode (``robust``, default on; ``robust=False`` takes every device at its word), as
synchronous MOCHA's (:mod:`fmtl_flower.strategies.linear_tasks`): R_t is
min(the device's ``max-row-norm``, the log-scale upper fence of every task's
(:func:`~fmtl_flower.core.robust.log_upper_fence`: 10 times their median unless the honest
values spread wider), the discovery limit); the ``n-train`` the budgets are computed from is
capped by the fence of the reported n's (and the discovery limit); the dual-image bound
above is on. A configured ``max_row_norm`` overrides the devices' reports. A task whose
updates are outliers is decoupled from the others (:mod:`fmtl_flower.core.async_mocha`,
"Decoupling"), logged, and listed in ``final``'s ``tasks_decoupled``.

Per-message state
-----------------
Each ``train`` message's state is made once, when the message is
(:meth:`AsyncMOCHA.send`): a :class:`SentRequest` holding the
:class:`~fmtl_flower.core.async_mocha.Request` it carries (task, request id, the w_t, m_tt,
sigma' and budget it was sent with, its staleness base ``version``), the message, its
message id and its own :class:`~fmtl_flower.strategies.trust.Exchange`. Its reply is read
against that state alone (:meth:`AsyncMOCHA.read_train_reply`: the boundary ties the reply to
the message by id, the parse checks its task and request id against the Request), and the
server checks its numbers against the same Request, which it keeps in flight per task (the
bounds and the certificate use the w the request was sent with, not the task's current
W column; b_t needs no copy: only the task's own replies change it and at most one is in
flight). What the safeguard computes (the ascent and curvature of applying the reply now)
is, by design, at the server's current W and M. On the wall clock the messages in flight are
an :class:`InFlight` keyed by message id; a reply that answers none of them (late after its
message expired, a second copy, or foreign) is logged and counted ``unknown`` and changes
nothing. On the virtual clock each message is pulled as it is sent; a reply the clock
delivers after its request expired is logged and counted ``unknown`` by the event loop.

Checkpoints
-----------
:meth:`AsyncMOCHA.enable_checkpoints` writes the state after every ``every x m`` applied
replies and after the last (:mod:`fmtl_flower.checkpoint`: atomic, pickle-free files
``round-NNNNNN.npz`` named by the rounds of work applied, applied replies // m; ``final``
says ``resumed_from``, in the same unit): the server's state and bookkeeping, the requests
in flight with their virtual send times and queue order, the records
(:meth:`~fmtl_flower.core.async_mocha.EventLoop.state_arrays`). A resumed run re-issues the
requests that were in flight, unchanged, at their original virtual times. Every request
carries ``keep-id``, the task's ``confirm-id`` at the newest checkpoint: the device keeps its
newest committed state not after it and goes back to it when the resumed server confirms
it. So with devices that kept their state the resumed run continues bit for bit (same
records, W, certificate); a device that lost its state restarts from alpha = 0 and says so
(the server resets b_t): consistent, not bit for bit. The devices keep their state in
``context.state``, which a real Flower deployment loses when a SuperNode restarts or the
resumed server starts a new Flower run; with a ``client-state-dir`` they also keep it in a
state file (:mod:`fmtl_flower.clients.async_mocha`), bound to their data and to the run's
``run-token`` (kept in the checkpoint), and continue from it.

Packed nodes
------------
On a :class:`~fmtl_flower.packing.PackedGrid` (``tasks-per-node`` > 1) each task on a node
keeps its own block of duals and its own request in flight, exactly as unpacked:
:meth:`PackedGrid.push_messages <fmtl_flower.packing.PackedGrid.push_messages>` sends each
request as a packed message of one slot, and its reply is split back to the task's virtual
node and read through the trust boundary like any other (a bad slot fails only its task).
This is the simpler correct design: the messages, the protocol and the records are those of
the unpacked run, bit for bit (a test checks it); a node-level request carrying all of a
node's tasks would make them wait for each other, a barrier inside the node. Packing saves no
messages here (one per request either way); it lets one Flower node host several tasks. On
a deployment the SuperNode (flwr 1.42) serves one message at a time, so the requests of a
node's tasks queue there behind each other (a loopback test runs two packed SuperNodes).

Real time
---------
On the simulation engines (in-process, Ray) the run keeps the virtual clock: each request is
pulled before the next event, so the wall-clock run is serial but the records are
reproducible. On a deployment (``clock="wall"``, which ``fmtl``'s ServerApp sets when its
grid is a SuperLink's) the run keeps real time (:class:`WallClockLoop`): up to
``concurrency`` requests are really in flight at once, each reply is applied as it arrives,
in arrival order, and a request unanswered ``pull_timeout_s`` seconds after it left
expires. The protocol and its guarantees do not depend on the clock (staleness is counted
in applied replies, not seconds). Records are stamped with wall seconds since the run
started; ``final`` says ``clock`` (``virtual`` or ``wall``) and ``time_s`` (the run's length
on it), and ``virtual_time_s`` is None on the wall clock. A checkpoint records its clock (a
run of the other clock refuses it). The eq. (30) times and ``latency-sigma`` only shape the
virtual clock.

Scope of this version: fixed Omega or Omega-steps with draining.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..checkpoint import check_fingerprint, read_checkpoint, write_checkpoint
from ..core.async_mocha import (
    APPLIED,
    INVALID,
    SIGMA_PRIME_RULES,
    UNKNOWN,
    AsyncMOCHAServer,
    Availability,
    EventLoop,
    Outcome,
    Rejected,
    Reply,
    ReplyBounds,
    Request,
    Run,
    advance_omega,
    event_record,
    latency_factor,
    log_unknown,
)
from ..core.certificate import PAIR_SLACK
from ..core.formulations import make_formulation
from ..core.losses import get_loss
from ..core.mocha import MOCHAServerState
from ..core.multiclass import (
    MAX_CLASS_NAME,
    Lifting,
    canonical_classes,
    decide_classes,
    natural_binary,
)
from ..core.robust import log_upper_fence
from ..systems.timing import node_times
from ..wire import array_record, config_record, from_array, message, record_dict
from .discovery import (
    MAX_N,
    MAX_ROW_NORM,
    ReplyError,
    arrays_of,
    read_metrics,
    wait_for_nodes,
)
from .trust import BOUND_SLACK, Exchange, ReplyBoundary, ReplyContract

if TYPE_CHECKING:
    from ..settings import MOCHASettings

NAME = "AsyncMOCHA"
#: The clocks a run can keep (:class:`AsyncMOCHA`'s ``clock``).
CLOCKS = ("virtual", "wall")
TRAIN_METRICS = ("task-id", "request-id", "delta-dual-mean", "loss-mean", "dual-mean", "steps",
                 "state-ok")
REPLY_CONTRACTS = {"train": ReplyContract.of(TRAIN_METRICS, {"delta-b": ("d",)})}


class AsyncMOCHA(Strategy):
    """Barrier-free MOCHA: no round barrier, a certified gap (module docstring).

    Parameters
    ----------
    lam : float
        lambda > 0.
    omega : str
        The formulation (:mod:`fmtl_flower.core.formulations`); ``formulation_options`` its
        other arguments (``lam2``, ...).
    concurrency : int or None
        The most requests in flight (None: every task).
    tau : int or None
        Staleness bound (None: unbounded while the tasks are uncoupled).
    latency_sigma : float
        The virtual clock's log-normal factor (0: deterministic eq. (30) times).
    latency_persistence : float
        The share of its log-variance that is per device (0: drawn for every request).
    offline_fraction, offline_mean_s : float
        The devices' offline windows on the virtual clock (fraction 0: always online;
        :class:`~fmtl_flower.core.async_mocha.Availability`).
    sigma_prime_rule : str
        ``stale-safe`` or ``synchronous`` (:data:`~fmtl_flower.core.async_mocha.SIGMA_PRIME_RULES`).
    gamma : float
        MOCHA's aggregation parameter in (0, 1].
    local_frac : float
        Local SDCA steps per request as a fraction of n_t.
    omega_every : int
        Omega-steps every ``omega_every x m`` applied replies (0: never), after draining.
    network, time_model : str
        Eq. (30)'s link and table (:mod:`fmtl_flower.systems.timing`).
    request_timeout_s : float or None
        Virtual seconds after which a request expires (None: 10 x the slowest request).
    pull_timeout_s : float
        Real seconds to wait for a pushed message's reply before counting it lost.
    seed : int
        The run seed.
    method, theta : str, float
        ``mocha``, or ``cocoa`` (the CoCoA baseline) with its theta in (0, 1).
    robust : bool
        Distrust the devices' claims (module docstring, "Robust mode").
    num_tasks : int or None
        The tasks to wait for: discovery waits (at most ``start``'s ``timeout``) until the
        grid has that many nodes (None: the nodes online when the run starts; on Ray they
        register after the ServerApp has started).
    max_row_norm : float or None
        The bound R on every task's training-row norms (None: each device's report).
    clock : {"virtual", "wall"}
        ``virtual``: the simulation engines' virtual clock (module docstring); ``wall``: real
        time, the replies applied as they arrive (deployments, "Real time"; ``fmtl``'s
        ServerApp chooses it on a deployment).
    on_round : callable, optional
        Called with the record that completes each ``m`` applied replies (a "round" of work).
    loss : str
        The loss (:data:`~fmtl_flower.core.losses.LOSSES`: ``hinge``, ``smoothed-hinge``,
        ``logistic``, ``squared``).
    fit_intercept, intercept_scaling, max_classes
        As synchronous MOCHA's (module docstring, "Multi-class and intercept").
    """

    def __init__(self, *, lam: float = 0.1, omega: str = "identity",
                 formulation_options: dict[str, Any] | None = None,
                 concurrency: int | None = None, tau: int | None = None,
                 latency_sigma: float = 0.0, gamma: float = 1.0, local_frac: float = 1.0,
                 omega_every: int = 0, network: str = "lte", time_model: str = "physical",
                 request_timeout_s: float | None = None, pull_timeout_s: float = 600.0,
                 seed: int = 0, method: str = "mocha", theta: float = 0.5,
                 robust: bool = True, max_row_norm: float | None = None,
                 num_tasks: int | None = None, clock: str = "virtual",
                 on_round: Callable[[dict[str, Any]], None] | None = None,
                 loss: str = "hinge", fit_intercept: bool = False,
                 intercept_scaling: float = 1.0, max_classes: int = 1000,
                 latency_persistence: float = 0.0, offline_fraction: float = 0.0,
                 offline_mean_s: float = 60.0,
                 sigma_prime_rule: str = "stale-safe") -> None:
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 (or None: every task), got {concurrency}")
        if tau is not None and tau < 0:
            raise ValueError(f"tau must be >= 0 (or None: unbounded), got {tau}")
        if not (math.isfinite(latency_sigma) and latency_sigma >= 0):
            raise ValueError(f"latency_sigma must be a finite number >= 0, got {latency_sigma}")
        latency_factor(seed, 0, 1, latency_sigma, latency_persistence)  # checks both
        self.latency_persistence = latency_persistence
        self.availability = None if offline_fraction == 0 else Availability(
            offline_fraction, offline_mean_s)
        if sigma_prime_rule not in SIGMA_PRIME_RULES:
            raise ValueError(f"sigma_prime_rule must be one of {SIGMA_PRIME_RULES}, got "
                             f"{sigma_prime_rule!r}")
        self.sigma_prime_rule = sigma_prime_rule
        self.lam, self.omega = lam, omega
        self.formulation_options = dict(formulation_options or {})
        self.concurrency, self.tau, self.latency_sigma = concurrency, tau, latency_sigma
        self.gamma, self.local_frac, self.omega_every = gamma, local_frac, omega_every
        self.network, self.time_model = network, time_model
        self.request_timeout_s, self.pull_timeout_s = request_timeout_s, pull_timeout_s
        self.seed, self.method, self.theta, self.on_round = seed, method, theta, on_round
        self.robust, self.max_row_norm = bool(robust), max_row_norm
        self.num_tasks, self.clock = num_tasks, clock
        self.loss = get_loss(loss).name
        if not (math.isfinite(intercept_scaling) and intercept_scaling > 0):
            raise ValueError(f"intercept_scaling must be a finite number > 0, got "
                             f"{intercept_scaling}")
        if max_classes < 2:
            raise ValueError(f"max_classes must be >= 2, got {max_classes}")
        self.fit_intercept, self.max_classes = bool(fit_intercept), int(max_classes)
        self.lifting = Lifting(None, float(intercept_scaling) if fit_intercept else 0.0)
        self.replies = ReplyBoundary(NAME, REPLY_CONTRACTS, sizes=lambda: {"d": self.dim})
        self.dim = 0
        self.run: Run | None = None
        self.checkpoint_dir: Path | None = None
        self.checkpoint_every, self.resume, self.resumed_from = 1, True, 0
        self.num_rounds = 0
        self.run_token: str | None = None  # drawn by start, or restored from the checkpoint
        self.sent_identity = ""  # the run's identity as its messages send it (run-token)
        self._decoupled_logged = 0

    @classmethod
    def for_run(cls, num_tasks: int, settings: MOCHASettings,
                on_round: Callable[[dict[str, Any]], None] | None = None) -> AsyncMOCHA:
        """The strategy of a run (as every family's: ``TaskStrategy.for_run``):
        :meth:`from_settings`."""
        return cls.from_settings(settings, on_round=on_round, num_tasks=num_tasks)

    @classmethod
    def from_settings(cls, settings: MOCHASettings,
                      on_round: Callable[[dict[str, Any]], None] | None = None,
                      num_tasks: int | None = None) -> AsyncMOCHA:
        """The strategy of ``fmtl run async-mocha`` / ``async-cocoa``: MOCHA's settings
        (lambda, the formulation and its options, local-frac, network, time model, gamma,
        theta, seed) and ``concurrency``, ``tau``, ``latency_sigma``. MOCHA's systems
        settings (sys-het, drop-prob, clock-cycle, ...) do not apply."""
        options = {k: v for k, v in settings.formulation_options.items() if k != "gamma"}
        return cls(lam=settings.lam, omega=settings.omega, formulation_options=options,
                   concurrency=settings.concurrency, tau=settings.tau,
                   latency_sigma=settings.latency_sigma, gamma=settings.gamma,
                   local_frac=settings.local_frac, omega_every=settings.omega_every,
                   network=settings.network, time_model=settings.time_model,
                   seed=settings.seed, theta=settings.theta, on_round=on_round,
                   robust=settings.robust, max_row_norm=settings.max_row_norm,
                   num_tasks=num_tasks,
                   method="cocoa" if settings.method == "async-cocoa" else "mocha",
                   loss=settings.loss, fit_intercept=settings.fit_intercept,
                   intercept_scaling=settings.intercept_scaling,
                   max_classes=settings.max_classes,
                   latency_persistence=settings.latency_persistence,
                   offline_fraction=settings.offline_fraction,
                   offline_mean_s=settings.offline_mean_s,
                   sigma_prime_rule=settings.sigma_prime_rule)

    # Strategy's round-based interface: not used (there are no rounds) -----------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        raise NotImplementedError("AsyncMOCHA has no rounds: run it with start()")

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> Any:
        raise NotImplementedError("AsyncMOCHA has no rounds: run it with start()")

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        raise NotImplementedError("AsyncMOCHA has no rounds: run it with start()")

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> Any:
        raise NotImplementedError("AsyncMOCHA has no rounds: run it with start()")

    def summary(self) -> None:
        """Log the settings."""
        log(INFO, "%s: lambda=%g omega=%s concurrency=%s tau=%s latency-sigma=%g loss=%s", NAME,
            self.lam, self.omega, self.concurrency, self.tau, self.latency_sigma, self.loss)

    # the run ---------------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int = 3,
              timeout: float = 3600) -> Result:
        """Discover the tasks, then apply ``num_rounds x m`` replies on the run's clock.

        Returns Flower's ``Result``; ``self.results()`` holds the records and ``final``
        (``primal``, ``dual``, ``gap``, ``virtual_time_s``, ``clock``, ``time_s``).
        """
        if not isinstance(num_rounds, int) or num_rounds < 1:
            raise ValueError(f"num_rounds must be an int >= 1, got {num_rounds!r}")
        self.summary()
        nodes, info = self._discover(grid, timeout)
        m = len(nodes)
        self._fix_lifting(info)
        n = self.lifting.n(np.array([info[t]["n-train"] for t in range(m)], dtype=np.int64))
        self.dim = self.lifting.dim(int(info[0]["dim"]))
        claimed = self.lifting.row_norm(np.array([info[t]["max-row-norm"] for t in range(m)]))
        self.row_norm = self._row_norms(claimed)
        budgets = np.maximum(np.floor(self.local_frac * self._budget_sizes(n)), 1
                             ).astype(np.int64)
        self.budgets, self.n = budgets, n
        seconds = node_times(budgets, self.dim, "mocha", self.network, model=self.time_model,
                             loss=self.loss)
        formulation = make_formulation(self.omega, m, lam=self.lam, **self.formulation_options)
        server = AsyncMOCHAServer(MOCHAServerState.zeros(self.dim, formulation), budgets,
                                  concurrency=m if self.concurrency is None else self.concurrency,
                                  tau=self.tau, gamma=self.gamma, seed=self.seed,
                                  method=self.method, theta=self.theta, loss=self.loss,
                                  bounds=ReplyBounds(self.row_norm, n, self.robust,
                                                     BOUND_SLACK, self.loss),
                                  sigma_prime_rule=self.sigma_prime_rule)
        self.run = Run(server, [])
        if self.clock == "wall":
            loop: EventLoop | WallClockLoop = WallClockLoop(
                self, grid, nodes, self.run, omega_every=self.omega_every,
                timeout_s=self.pull_timeout_s)
        else:
            loop = EventLoop(self.run, seconds, _GridTransport(self, grid, nodes),
                             latency_sigma=self.latency_sigma, seed=self.seed,
                             omega_every=self.omega_every, timeout_s=self.request_timeout_s,
                             latency_persistence=self.latency_persistence,
                             availability=self.availability)
        self.num_rounds = num_rounds
        if self.checkpoint_dir is not None and self.resume:
            self._resume(loop)
        if self.run_token is None:
            self.run_token = secrets.token_hex(8)
        self.sent_identity = self.run_identity()
        loop.run(num_rounds * m, on_event=lambda run, record: self._on_event(record, m),
                 after_event=None if self.checkpoint_dir is None else self._maybe_checkpoint)
        server = self.run.server
        result = Result()
        result.arrays = ArrayRecord({"W": array_record({"W": server.state.W})["W"]})
        final = self.results()["final"]
        result.evaluate_metrics_serverapp[num_rounds] = MetricRecord(
            {k: v for k, v in final.items() if isinstance(v, (int, float))})
        return result

    # checkpoints -----------------------------------------------------------------------------
    def enable_checkpoints(self, directory: str | Path, every: int = 1,
                           resume: bool = True) -> None:
        """Write a checkpoint after every ``every x m`` applied replies (``every`` rounds of
        work) and the last; with ``resume``, continue from the newest one in ``directory``
        when the run starts (module docstring, "Checkpoints")."""
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint every must be an int >= 1, got {every!r}")
        self.checkpoint_dir, self.checkpoint_every = Path(directory), every
        self.resume = bool(resume)

    def fingerprint(self) -> dict[str, Any]:
        """The settings a checkpoint must have been written with to be resumed."""
        return {"strategy": NAME, "num_tasks": self.run.server.state.num_tasks if self.run
                else None, "lam": self.lam, "omega": self.omega,
                "formulation": self.formulation_options, "concurrency": self.concurrency,
                "tau": self.tau, "latency_sigma": self.latency_sigma, "gamma": self.gamma,
                "local_frac": self.local_frac, "omega_every": self.omega_every,
                "network": str(self.network), "time_model": self.time_model,
                "request_timeout_s": self.request_timeout_s, "seed": self.seed,
                "method": self.method, "theta": self.theta, "robust": self.robust,
                "max_row_norm": self.max_row_norm, "clock": self.clock,
                **({"loss": self.loss} if self.loss != "hinge" else {}),
                **({"intercept_scaling": self.lifting.intercept_scaling}
                   if self.fit_intercept else {})}

    def run_identity(self) -> str:
        """The run's identity sent as ``run-token`` (as the synchronous strategies',
        :meth:`fmtl_flower.strategies.base.TaskStrategy.run_identity`): the run's token, then
        ``.`` and 16 hex digits of a digest of :meth:`fingerprint`. Devices bind their state
        (and state files) to it; a resumed run keeps the checkpoint's token."""
        settings = json.dumps(self.fingerprint(), sort_keys=True, default=str)
        digest = hashlib.blake2b(settings.encode(), digest_size=8).hexdigest()
        return f"{self.run_token}.{digest}"

    def _maybe_checkpoint(self, loop: EventLoop, record: dict[str, Any]) -> None:
        """After an event: write a checkpoint when ``every x m`` more replies were applied,
        or the run's last one was."""
        m = loop.server.state.num_tasks
        applied = record["applied"]
        if record["status"] != APPLIED or (applied % (self.checkpoint_every * m)
                                           and applied != self.num_rounds * m):
            return
        assert self.checkpoint_dir is not None
        arrays, meta = loop.state_arrays()
        path = write_checkpoint(self.checkpoint_dir, applied // m, arrays,
                                {**meta, "fingerprint": self.fingerprint(),
                                 "run_token": self.run_token})
        log(INFO, "%s: checkpoint after %d applied replies written to %s", NAME, applied, path)

    def _resume(self, loop: EventLoop) -> None:
        """Continue from the newest checkpoint, if any (its settings must be this run's)."""
        assert self.checkpoint_dir is not None
        checkpoint = read_checkpoint(self.checkpoint_dir)
        if checkpoint is None:
            log(INFO, "%s: no checkpoint in %s; starting afresh", NAME, self.checkpoint_dir)
            return
        check_fingerprint(checkpoint, self.fingerprint())
        loop.restore(checkpoint.arrays, checkpoint.meta)
        self.resumed_from = checkpoint.server_round
        token = checkpoint.meta.get("run_token")
        self.run_token = token if isinstance(token, str) and token else None
        log(INFO, "%s: resumed from %s (%d rounds of replies applied; %d requests in flight "
            "re-issued)", NAME, checkpoint.path, checkpoint.server_round,
            len(loop.server.in_flight))

    def _row_norms(self, claimed: np.ndarray) -> np.ndarray:
        """R_t: the configured ``max_row_norm``, else the devices' claims, in robust mode
        capped by their log-scale upper fence and the discovery limit."""
        if self.max_row_norm is not None:
            return np.full(claimed.shape, float(self.max_row_norm))
        if not self.robust:
            return claimed
        return np.minimum(claimed, min(log_upper_fence(claimed), MAX_ROW_NORM))

    def _budget_sizes(self, n: np.ndarray) -> np.ndarray:
        """The ``n-train`` the budgets come from: as reported, in robust mode capped by the
        log-scale upper fence of the reported n's and the discovery limit."""
        if not self.robust:
            return n
        return np.minimum(n, math.floor(min(log_upper_fence(n), MAX_N)))

    def _on_event(self, record: dict[str, Any], m: int) -> None:
        """Log, and pass each completed round's record (m more replies applied) to
        ``on_round``."""
        self._log_decoupling()
        rejected = self.run.server.last_rejection if self.run is not None else None
        if record["status"] == INVALID and rejected is not None \
                and rejected.task == record["task"]:
            log(WARNING, "%s: task %d's reply rejected: %s", NAME, rejected.task,
                rejected.reason)
            self.run.server.last_rejection = None
            return
        _log_record(record, m)
        if self.on_round is not None and record["status"] == APPLIED \
                and record["applied"] % m == 0:
            self.on_round(record)

    def _log_decoupling(self) -> None:
        """Log the tasks robust mode decoupled since the last event (once each)."""
        server = self.run.server if self.run is not None else None
        if server is None or len(server.decoupled_log) <= self._decoupled_logged:
            return
        for applied, tasks in server.decoupled_log[self._decoupled_logged:]:
            log(WARNING, "%s: task%s %s decoupled from the others after %d applied replies "
                "(off-diagonal coupling in M set to 0 for the rest of the run): their updates "
                "are outliers against the federation's (robust mode)", NAME,
                "s" if len(tasks) > 1 else "", tasks[:20], applied)
        self._decoupled_logged = len(server.decoupled_log)

    def _fix_lifting(self, info: dict[int, dict[str, Any]]) -> None:
        """The run's class list from the devices' ``classes`` (one vote per node,
        :func:`~fmtl_flower.core.multiclass.decide_classes`, as synchronous MOCHA's): none
        reported, or the binary labels, keep the binary problem; two other labels are binary
        too; more make the one-vs-rest lifting. A refused node's messages fail (theta = 1)."""
        votes = {v["node"]: v["classes"] for v in info.values() if "classes" in v}
        if not votes:
            return
        classes, refused = decide_classes(votes, self.robust, self.max_classes)
        log(INFO, "%s: %d classes %s, decided by the %d nodes that reported their labels%s",
            NAME, len(classes), list(classes)[:20], len(votes),
            f"; refused: {refused}" if refused else "")
        lifted = None if not classes or natural_binary(classes) else classes
        self.lifting = Lifting(lifted, self.lifting.intercept_scaling)

    def results(self) -> dict[str, Any]:
        """``rounds``: one time-stamped record per reply event (``time_s`` seconds on the
        run's clock, ``applied``, ``round`` = applied // m, ``status``, ``task``,
        ``staleness``, ``gamma``, ``dual``, ``primal``, ``gap``), and ``final`` (``primal``,
        ``dual``, ``gap`` of the certificate, ``clock`` (``virtual`` or ``wall``),
        ``time_s`` (the run's length on that clock), ``virtual_time_s`` (None on the wall
        clock: there is no virtual time), ``round``, the reply counts)."""
        if self.run is None:
            return {"rounds": [], "final": {}}
        server, records = self.run.server, self.run.records
        cert = server.certificate()
        m = server.state.num_tasks
        final = {"round": server.counts[APPLIED] // m,
                 "primal": None if cert is None else cert.primal, "dual": server.dual(),
                 "gap": None if cert is None else cert.gap,
                 "clock": self.clock, "time_s": self.run.virtual_time_s,
                 "virtual_time_s": self.run.virtual_time_s if self.clock == "virtual"
                 else None,
                 "replies_applied": server.counts[APPLIED], "resumed_from": self.resumed_from,
                 "certificate_rejections_total": server.certificate_rejections,
                 "tasks_decoupled": np.flatnonzero(server.decoupled).tolist(), **{
                     f"replies_{k}": v for k, v in server.counts.items() if k != APPLIED}}
        return {"rounds": records, "final": final}

    def _discover(self, grid: Grid, timeout: float) -> tuple[list[int], dict[int, dict]]:
        """Ask every node ``whoami``; tasks must be 0 .. m-1 with one node each."""
        if self.num_tasks:
            wait_for_nodes(grid, self.num_tasks, timeout, NAME)
        self.replies.begin()
        sent = [self.replies.track(-1 - i, node, message(record_dict({}), node, "query.whoami"))
                for i, node in enumerate(grid.get_node_ids())]
        by_node = {msg.metadata.dst_node_id: -1 - i for i, msg in enumerate(sent)}
        replies = grid.send_and_receive(sent, timeout=timeout)
        got = self.replies.read("setup", replies,
                                lambda reply, slot: _parse_whoami(reply, slot, self.max_classes))
        info = {v["task-id"]: {**v, "node": node} for node, slot in by_node.items()
                if (v := got.accepted.get(slot)) is not None}
        m = len(info)
        if m == 0 or sorted(info) != list(range(m)):
            raise RuntimeError(f"{NAME}: tasks must be 0 .. m-1 with one node each, found "
                               f"{sorted(info)}")
        dims = {v["dim"] for v in info.values()}
        if len(dims) != 1:
            raise RuntimeError(f"{NAME}: nodes disagree on the dimension: {sorted(dims)}")
        return [info[t]["node"] for t in range(m)], info

    def train_message(self, request: Request, node: int) -> Message:
        """The ``train`` message of ``request`` to ``node`` (wire contract)."""
        config = config_record({
            "task-id": request.task, "request-id": request.request_id, "count": request.count,
            "m-tt": request.m_tt, "sigma-prime": request.sigma_prime, "budget": request.budget,
            "seed": request.seed, "confirm-id": request.confirm_id,
            "confirm-gamma": request.confirm_gamma, "method": request.method,
            "theta": request.theta, "keep-id": request.keep_id,
            "run-token": self.sent_identity,
            **({"loss": request.loss} if request.loss != "hinge" else {}),
            **self.lifting.config()})
        return message(record_dict({"arrays": array_record({"w": request.w}),
                                    "config": config}), node, "train")

    def send(self, request: Request, node: int, grid: Grid) -> SentRequest:
        """Make ``request``'s ``train`` message to ``node``, push it, and return its
        :class:`SentRequest`: the one state its reply is read against."""
        msg = self.train_message(request, node)
        exchange = Exchange()
        exchange.track(request.task, node, msg)
        ids = list(grid.push_messages([msg]))
        return SentRequest(request, msg, exchange, ids[0] if ids else None, time.monotonic())

    def read_train_reply(self, sent: SentRequest, replies: list[Message]
                         ) -> Reply | Rejected | None:
        """What the trust boundary makes of the replies to ``sent``'s message, read against
        ``sent`` alone (its exchange, its request): the :class:`Reply`, a :class:`Rejected`
        (theta = 1, logged), or None (no reply for it: lost)."""
        request = sent.request
        got = self.replies.read(f"request {request.request_id}", replies,
                                lambda reply, _task: {"reply": self.parse_train(reply, request)},
                                exchange=sent.exchange)
        if request.task in got.accepted:
            return got.accepted[request.task]["reply"]
        if request.task in got.failed:
            return Rejected(request.task, request.request_id)
        return None

    def parse_train(self, reply: Message, request: Request) -> Reply:
        """Decode and check one ``train`` reply (raises on anything wrong)."""
        values = read_metrics(reply, ints=("task-id", "request-id", "steps", "state-ok"),
                              numbers=("delta-dual-mean", "loss-mean", "dual-mean"))
        if values["task-id"] != request.task or values["request-id"] != request.request_id:
            raise ReplyError(f"reply for task {values['task-id']} request "
                             f"{values['request-id']}, expected {request.task} "
                             f"{request.request_id}")
        arrays = arrays_of(reply)
        if arrays is None or "delta-b" not in arrays:
            raise ReplyError("no array 'delta-b'")
        d_b = from_array(arrays["delta-b"])
        if d_b.dtype != np.float64 or d_b.shape != (self.dim,) or not np.isfinite(d_b).all():
            raise ReplyError(f"'delta-b' must be finite float64 ({self.dim},)")
        t = request.task
        lo, hi = get_loss(self.loss).dual_range
        slack = PAIR_SLACK * (1.0 + abs(hi))  # a mean of values at the top may round above it
        if abs(values["delta-dual-mean"]) > hi - lo or values["loss-mean"] < 0 \
                or not lo - slack <= values["dual-mean"] <= hi + slack \
                or values["state-ok"] not in (0, 1):
            raise ReplyError("delta-dual-mean, loss-mean, dual-mean or state-ok out of range "
                             f"(the {self.loss} loss's dual range [{lo:.6g}, {hi:.6g}])")
        return Reply(t, request.request_id, d_b, float(values["delta-dual-mean"]),
                     float(values["loss-mean"]), float(values["dual-mean"]),
                     int(values["steps"]), bool(values["state-ok"]))


class _GridTransport:
    """Sends a request as a ``train`` message and returns what the boundary made of its
    reply: a :class:`Reply`, a :class:`Rejected`, or nothing (no reply in time: lost)."""

    def __init__(self, strategy: AsyncMOCHA, grid: Grid, nodes: list[int]) -> None:
        self.strategy, self.grid, self.nodes = strategy, grid, nodes

    def __call__(self, request: Request) -> list[Reply | Rejected]:
        s = self.strategy
        sent = s.send(request, self.nodes[request.task], self.grid)
        ids = [] if sent.message_id is None else [sent.message_id]
        delivery = s.read_train_reply(sent, self._pull(ids))
        return [] if delivery is None else [delivery]

    def _pull(self, ids: list[str]) -> list[Message]:
        deadline = time.monotonic() + self.strategy.pull_timeout_s
        while ids:
            replies = list(self.grid.pull_messages(ids))
            if replies or time.monotonic() > deadline:
                return replies
            time.sleep(0.01)
        return []


@dataclass(frozen=True, eq=False)
class SentRequest:
    """One ``train`` message's state, made once, when the message is
    (:meth:`AsyncMOCHA.send`): its reply is matched to it by message id and checked against
    it alone (module docstring, "Per-message state").

    Attributes
    ----------
    request : Request
        What was sent: the task, the request id, w_t, m_tt, sigma', the budget, the
        staleness base (``version``), the confirm and keep ids.
    message : Message
        The ``train`` message.
    exchange : Exchange
        The trust boundary's record of the message (:meth:`ReplyBoundary.read
        <fmtl_flower.strategies.trust.ReplyBoundary.read>` reads the reply against it).
    message_id : str or None
        The id the grid gave the message (None: the grid could not send it).
    sent_at : float
        When it left (``time.monotonic()``).
    """

    request: Request
    message: Message
    exchange: Exchange
    message_id: str | None
    sent_at: float


class InFlight:
    """The ``train`` messages in flight in real time: each one's :class:`SentRequest`, keyed
    by its message id (a message the grid could not send is kept only until it expires)."""

    def __init__(self) -> None:
        self._by_message: dict[str, SentRequest] = {}
        self._unsent: list[SentRequest] = []

    def __len__(self) -> int:
        return len(self._by_message) + len(self._unsent)

    def add(self, sent: SentRequest) -> None:
        """Keep ``sent`` until its reply is read or it expires."""
        if sent.message_id is None:
            self._unsent.append(sent)
        else:
            self._by_message[sent.message_id] = sent

    def message_ids(self) -> list[str]:
        """The ids of the messages whose replies are awaited, in the order they were sent."""
        return list(self._by_message)

    def get(self, message_id: Any) -> SentRequest | None:
        """The state of the message ``message_id`` answers (None: no message in flight)."""
        return self._by_message.get(message_id) if isinstance(message_id, str) else None

    def remove(self, sent: SentRequest) -> None:
        """Forget ``sent`` (its reply was read)."""
        self._by_message.pop(sent.message_id, None)

    def expire(self, now: float, timeout_s: float) -> list[SentRequest]:
        """Remove and return the messages in flight for longer than ``timeout_s``."""
        late = [s for s in [*self._by_message.values(), *self._unsent]
                if now - s.sent_at > timeout_s]
        self._by_message = {mid: s for mid, s in self._by_message.items()
                            if now - s.sent_at <= timeout_s}
        self._unsent = [s for s in self._unsent if now - s.sent_at <= timeout_s]
        return late


class WallClockLoop:
    """The protocol in real time (deployments; module docstring, "Real time").

    Requests are pushed to up to ``concurrency`` tasks (``Grid.push_messages``); the loop
    polls ``Grid.pull_messages`` for every request in flight and applies each reply as it
    arrives, in arrival order, through the trust boundary, then pushes new work to the task
    that replied. A request unanswered ``timeout_s`` real seconds after it left expires
    (theta = 1). Omega-steps drain as on the virtual clock. Records are stamped with the
    seconds since the run started (a resumed run's clock continues from its checkpoint).
    Same interface as :class:`~fmtl_flower.core.async_mocha.EventLoop` (``run``,
    ``state_arrays``, ``restore``); a resumed run re-pushes the requests that were in
    flight, unchanged.
    """

    def __init__(self, strategy: AsyncMOCHA, grid: Grid, nodes: list[int], run: Run, *,
                 omega_every: int = 0, timeout_s: float = 600.0, poll_s: float = 0.05) -> None:
        self.strategy, self.grid, self.nodes = strategy, grid, nodes
        self.run_, self.server = run, run.server
        m = self.server.state.num_tasks
        self.idle = deque(range(m))
        self.omega_due = omega_every * m if omega_every > 0 else 0
        self.draining = False
        self.timeout_s, self.poll_s = float(timeout_s), float(poll_s)
        self.flight = InFlight()  # the messages pushed and not yet answered or expired
        self.offset = 0.0  # the clock's reading when this process's part of the run began
        self.started = time.monotonic()

    def now(self) -> float:
        """Seconds since the run started (on a resumed run: since the original start)."""
        return self.offset + time.monotonic() - self.started

    def push(self, request: Request) -> None:
        """Push ``request``'s ``train`` message now."""
        self.flight.add(self.strategy.send(request, self.nodes[request.task], self.grid))

    def fill(self) -> None:
        """Send work to idle tasks while the server may issue (not while draining)."""
        while not self.draining and self.idle and self.server.can_issue():
            self.push(self.server.issue(self.idle.popleft()))

    def run(self, replies: int, *,
            on_event: Callable[[Run, dict[str, Any]], None] | None = None,
            after_event: Callable[[WallClockLoop, dict[str, Any]], None] | None = None
            ) -> Run:
        """Apply replies as they arrive until ``replies`` are applied (or no request is left
        in flight, or ``10 x replies + m`` requests were issued)."""
        server, m = self.server, self.server.state.num_tasks
        self.started = time.monotonic()
        if server.counts[APPLIED] < replies:  # a resumed run: re-push what was in flight
            for request in sorted(server.in_flight.values(), key=lambda r: r.request_id):
                self.push(request)
        self.fill()
        max_requests = 10 * replies + m
        while self.flight and server.counts[APPLIED] < replies \
                and server.next_id <= max_requests:
            events = self._arrivals() + self._expiries()
            if not events:
                time.sleep(self.poll_s)
                continue
            for sent, delivery in events:
                if server.counts[APPLIED] >= replies:
                    break
                self._handle(sent, delivery, replies, on_event, after_event)
        self.run_.virtual_time_s = self.now()
        return self.run_

    def _arrivals(self) -> list[tuple[SentRequest, Reply | Rejected]]:
        """The replies that arrived, each read through the trust boundary against the state
        of the message it answers (a reply the boundary ignored, e.g. from another node,
        leaves its message in flight; a reply that answers no message in flight is a
        logged drop, :meth:`_drop_stray`)."""
        ids = self.flight.message_ids()
        if not ids:
            return []
        out = []
        for reply in self.grid.pull_messages(ids):
            sent = self.flight.get(_answers(reply))
            if sent is None:
                self._drop_stray(reply)
                continue
            delivery = self.strategy.read_train_reply(sent, [reply])
            if delivery is not None:
                self.flight.remove(sent)
                out.append((sent, delivery))
        return out

    def _drop_stray(self, reply: Message) -> None:
        """A reply that answers no message in flight (late after its message expired, a
        second reply to a message, or a reply to a message this run never sent): logged,
        counted ``unknown``, otherwise ignored."""
        log(WARNING, "%s: a reply to message %r answers no train message in flight (late "
            "after its expiry, a duplicate, or foreign); dropped", NAME, _answers(reply))
        self.server.count_stray()

    def _expiries(self) -> list[tuple[SentRequest, None]]:
        """The messages in flight for longer than the timeout (removed from the flight)."""
        return [(sent, None) for sent in self.flight.expire(time.monotonic(), self.timeout_s)]

    def _handle(self, sent: SentRequest, delivery: Reply | Rejected | None, replies: int,
                on_event: Callable[[Run, dict[str, Any]], None] | None,
                after_event: Callable[[WallClockLoop, dict[str, Any]], None] | None) -> None:
        """Apply one arrival or expiry (``delivery`` None), record it, Omega-step when due,
        send new work."""
        server, request = self.server, sent.request
        if isinstance(delivery, Reply):
            outcome = server.receive(delivery)
        elif isinstance(delivery, Rejected):
            outcome = server.reject(delivery.task, delivery.request_id)
        else:
            outcome = (Outcome("expired", request.task, request.request_id)
                       if server.expire(request.task, request.request_id) else None)
        if outcome is not None and outcome.status == UNKNOWN:
            log_unknown(outcome)
        if outcome is None or outcome.status == UNKNOWN:
            return
        self.idle.append(outcome.task)
        record = event_record(server, self.now(), outcome)
        self.run_.records.append(record)
        if on_event is not None:
            on_event(self.run_, record)
        advance_omega(self, outcome, replies)
        self.fill()
        if after_event is not None:
            after_event(self, record)

    # --- checkpoints
    def state_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The server's state and the loop's (``(arrays, JSON meta)``), after an event."""
        arrays, meta = self.server.state_arrays()
        meta.update(now=self.now(), idle=list(self.idle), draining=self.draining,
                    records=self.run_.records)
        return arrays, meta

    def restore(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Continue from :meth:`state_arrays`' output (the requests in flight are pushed
        again, unchanged, when the run goes on)."""
        self.server.restore(arrays, meta)
        self.run_.records = [dict(r) for r in meta["records"]]
        self.idle = deque(int(t) for t in meta["idle"])
        self.draining = bool(meta["draining"])
        self.offset = float(meta["now"])


def _answers(reply: Any) -> Any:
    """The id of the message ``reply`` answers (None for a malformed reply object)."""
    try:
        return reply.metadata.reply_to_message_id
    except Exception:  # noqa: BLE001 - a malformed reply answers nothing
        return None


def _parse_whoami(reply: Message, _slot: int, max_classes: int) -> dict[str, Any]:
    if "info" not in reply.content:
        raise ReplyError("no 'info' record")
    info = dict(reply.content["info"].items())
    out = {}
    for key, kind in (("task-id", int), ("n-train", int), ("dim", int),
                      ("max-row-norm", float)):
        value = info.get(key)
        if kind is float and type(value) is int:
            value = float(value)
        if type(value) is not kind or (kind is float and not math.isfinite(value)):
            raise ReplyError(f"'{key}' missing or not a {kind.__name__}")
        out[key] = value
    if out["task-id"] < 0 or out["n-train"] < 1 or out["dim"] < 1 or out["max-row-norm"] < 0:
        raise ReplyError("task-id, n-train, dim or max-row-norm out of range")
    if "classes" in info:
        out["classes"] = _read_classes(info["classes"], max_classes)
    return out


def _read_classes(value: Any, max_classes: int) -> tuple[Any, ...]:
    """A whoami's ``classes``: a non-empty list of at most ``max_classes`` labels (numbers,
    or strings of at most MAX_CLASS_NAME characters), canonical and sorted."""
    if not isinstance(value, list) or not value:
        raise ReplyError(f"'classes' must be a non-empty list, got {type(value).__name__}")
    if len(value) > max_classes:
        raise ReplyError(f"{len(value)} classes above the limit {max_classes}")
    if any(isinstance(v, bytes | bool) or (isinstance(v, str) and len(v) > MAX_CLASS_NAME)
           for v in value):
        raise ReplyError(f"'classes' must hold numbers or strings of at most {MAX_CLASS_NAME} "
                         "characters")
    try:
        return canonical_classes(value)
    except ValueError as err:
        raise ReplyError(f"'classes': {err}") from None


def _log_record(record: dict[str, Any], m: int) -> None:
    applied = record["applied"]
    if record["status"] != APPLIED:
        log(WARNING, "%s: task %d's reply %s", NAME, record["task"], record["status"])
    elif applied % m == 0 and record["gap"] is not None:
        log(INFO, "%s: %d replies applied (%.2f rounds), t = %.3f s, gap %.3e", NAME, applied,
            applied / m, record["time_s"], record["gap"])
