"""MOCHA (Smith et al., NeurIPS 2017) as a Flower ``Strategy``.

Wire contract
-------------
Every message to a task's node carries a ``config`` ConfigRecord and an ``arrays`` ArrayRecord.

query ``whoami`` (server -> node): empty ``config``. Reply: ConfigRecord ``info`` with
    ``task-id`` (int, 0 <= id < num_tasks), ``n-train`` (int >= 1), ``n-test`` (int >= 0),
    ``dim`` (int, the same on every node), ``max-row-norm`` (float, max_i |x_ti|_2 over the
    training rows; bounds the task's ``delta-b``, below), optional ``classes`` (list of int,
    float or str: the distinct labels of the device's train and test data, sent by devices
    built with ``labels="auto"``; at most ``max_classes`` of them). Sizes beyond the
    discovery limits and a ``dim`` other than the majority's exclude the node
    (:mod:`fmtl_flower.strategies.discovery`). ``n-train``, ``dim`` and ``max-row-norm`` are
    of the data as loaded; the server lifts them (below, "Multi-class and intercept").

``train`` (server -> node):
    arrays ``w``: float64 (d,), the task's model w_t = W(alpha)[:, t];
    config ``task-id`` int, ``server-round`` int, ``last-accepted-round`` int (the newest round
    whose reply from this task the server added to B; 0 = none), ``m-tt`` float > 0 (the
    diagonal entry (K^-1)_tt), ``sigma-prime`` float > 0, ``budget`` int >= 0 (coordinate
    steps), ``seed`` int, ``dropped`` bool (simulated drop-out: do no work), ``eval`` bool
    (also report test errors of w_t), ``run-token`` str (the run's identity: the device's
    state of another run is not resumed, :mod:`fmtl_flower.strategies.base`), optional
    ``checkpoint-round`` int (the round of the server's newest checkpoint, 0 = none; sent
    when checkpoints are on: the device keeps its alpha as of that checkpoint to go back to
    if the server resumes from it), optional
    ``gamma`` float in (0, 1] (default 1: the device applies and sends gamma * d_alpha,
    gamma * d_b), optional ``method`` str
    (``mocha`` by default; ``cocoa`` with ``theta`` float: SDCA until the local gap falls by
    theta, ``budget`` is the cap; ``mb-sdca`` with ``scale`` float: stale-model steps on
    ``budget`` distinct samples, update scaled by ``scale``), optional ``classes`` (list: the
    run's sorted class list, sent unless the labels are the binary -1/+1 or 0/1) and
    ``intercept-scaling`` float > 0 (sent when the run fits an intercept): the device
    prepares its data as they say (below) before anything else; ``evaluate`` too; optional
    ``loss`` str (sent when the run's loss is not ``hinge``, the default: ``smoothed-hinge``,
    ``logistic`` or ``squared``, :mod:`fmtl_flower.core.losses`; the device's coordinate
    steps, ``loss-mean`` and ``dual-mean`` are that loss's, and its dual state is bound to it).
    Seeding round (round 1 of a fresh run started with ``initial_arrays``, see
    :meth:`MOCHA.seed_model`): also arrays ``seed-w`` and ``seed-b``, float64 (d,) each, the
    target model W0[:, t] and dual image (W0 K)[:, t]; ``budget`` = n-train, ``dropped``
    false. The device then runs no solver (``method``, ``gamma``, ``scale`` do not apply) but
    moves its alpha to the seeding point of :mod:`fmtl_flower.clients.dual_seed`, a feasible
    dual change like any other (same reply, ``steps`` = the seeding's coordinate steps).
    Stacked messages carry them as (K, d) rows (:mod:`fmtl_flower.clients.packed_mocha`).
    Reply: arrays ``delta-b`` float64 (d,) = X_t^T d_alpha / n_t; metrics ``task-id``,
    ``round`` (= server-round), ``n-train``, ``state-ok`` (0/1: 0 = the device restarted from
    alpha = 0), ``loss-mean`` (mean loss at the w_t received), ``dual-mean``
    (mean of the loss's dual term D(y * alpha) = -l*(-y * alpha) after the commit; for the
    hinge the mean of y * alpha), ``steps`` (int, coordinate steps done), and with
    ``eval`` ``test-errors``, ``test-n`` (ints).

``evaluate`` (server -> node, once, after the last round): the same ``w`` and ``config``
    (``eval`` true); reply: the same metrics, no arrays.

Multi-class and intercept
-------------------------
(:mod:`fmtl_flower.core.multiclass`, the maths in ``docs/guides/mocha.md``.) At the first
discovery the server decides the run's class list from the ``classes`` of the nodes (one
vote per physical node, :func:`~fmtl_flower.core.multiclass.decide_classes`: every class an
admitted node holds, so a class only one device holds is one; in robust mode a node claiming
more classes than the log-scale fence of the nodes' counts is refused; a node claiming more
than ``max_classes`` (``mocha.max-classes``, default 1000) is refused at its whoami; the
list is at most ``max_classes`` long). The refused nodes, and the nodes whose labels lie
outside the list (now or when they appear later), are excluded with the reason. No votes,
or labels within {-1, +1} or {0, 1}: today's binary problem, nothing more is sent. Two other
labels: binary, c_0 -> -1, c_1 -> +1. K > 2: one-vs-rest over K blocks with one Omega; each
w_t then has (d + 1 with an intercept) * K entries, task t has n_t * K lifted samples
(:attr:`MOCHA.n_train`, the budgets and the ``n-train`` of the replies), and the row-norm
bound R_t becomes sqrt(R_t**2 + ``intercept-scaling``**2) with an intercept
(``fit_intercept``, ``mocha.fit-intercept``: a constant feature the devices append). The
SDCA kernel, the dual, sigma', the certificate's check, the bounds above and the server's
updates are those of the binary problem on the lifted data. Checkpoints keep the class
list. Packed nodes lift every slot alike.

Every reply is validated (keys, dtypes, shapes, finite values, matching task and round); a
reply that fails counts as a dropped node with a logged reason and leaves the state untouched.
A reply holding anything the contract above does not name (another record, metric or array,
or arrays above the bytes of ``delta-b``'s shape) is rejected before it is decoded
(:data:`REPLY_CONTRACTS`, :class:`~fmtl_flower.strategies.trust.ReplyContract`).

Packed nodes (:mod:`fmtl_flower.packing`) that speak the stacking protocol ``"mocha"`` get the
same ``train`` and ``evaluate`` contents for all of their tasks in ONE message, stacked (``w``
as a (K, d) array, every per-task value as a vector) and reply with the stacked metrics and
``delta-b``; contract in :mod:`fmtl_flower.clients.packed_mocha`. Each row is validated as
above, in vectorised form; a bad row or failed slot drops only its task.

Bounds (what a feasible dual step can send; each violation rejects the reply). With
R_t the largest row norm of task t's training data (``max-row-norm`` of its ``whoami``
reply, or the run's ``max_row_norm`` when configured, which overrides the devices'), every
dual variable stays in its feasible range (y_ti alpha_ti in [0, 1] for the hinge, the
smoothed hinge and the logistic loss), so one step changes each alpha_ti by at most 1 and
touches at most min(budget, n_t) of them:

* ``|delta-b|_2 <= R_t min(budget, n_t) / n_t`` (0 when ``dropped``); the squared loss's
  dual domain is unbounded, so for it only the 0 of ``dropped`` is checked;
* a task whose device reported no ``max-row-norm`` cannot be bounded: all its replies (the
  final ``evaluate`` round's too, whose ``loss-mean`` enters the record) are rejected unless
  the run configures ``max_row_norm``;
* ``0 <= loss-mean <= l-bound(R_t |w_t|)`` (the loss at margins |z| <= R_t |w_t|: 1 + R|w|
  for the hinge, 1/2 + R|w| smoothed, log 2 + R|w| logistic, (1 + R|w|)^2 / 2 squared),
  ``dual-mean`` in the range of the loss's dual term ([0, 1] for the hinge),
  ``0 <= test-errors <= test-n <=`` the discovery limit ``max_n``;
* the certificate's check: ``loss-mean - dual-mean + w_t . b_t >= 0`` (Fenchel-Young for a
  truthful pair, up to a relative rounding slack; w_t as sent, b_t = X_t^T alpha_t / n_t as
  the server holds it, 0 for a device that replied ``state-ok`` 0), so that a gap made of
  pairs that passed is >= 0 (:mod:`fmtl_flower.core.certificate`). Always on (``robust``
  does not gate it): an honest pair passes it.

After the round's updates W must be finite (else they are rolled back and the round's replies
rejected); an Omega-step that raises or leaves W or M non-finite is undone (Omega kept).

Robust mode (``robust``, default on; ``robust=False`` takes every device at its word, as
before) guards this contract with what the federation makes plausible:

* R_t is capped: R~_t = min(``max-row-norm``_t, the log-scale upper fence of all tasks'
  reported ``max-row-norm`` (10 times their median, or 5 MADs of their logs if the honest
  values spread wider), the discovery limit) (:mod:`~fmtl_flower.strategies.linear_tasks`);
  every bound above uses R~_t. A configured ``max_row_norm`` overrides it, as before;
* the ``n-train`` the budgets are computed from is capped by the fence of the tasks'
  ``n-train`` (n enters the |delta-b| bound only as min(budget, n) / n <= 1, and Mb-SDCA's
  update scale through the round's total of steps, which one huge claim would shrink);
* ``|b_t + delta-b|_2 <= R~_t`` (b_t the task's accumulated dual image on the server, 0 after
  a restart): b_t = X_t^T alpha_t / n_t with every |alpha_ti| <= 1, so no feasible alpha has
  a larger one, however its steps are spread over rounds (not for the squared loss, whose
  alpha is unbounded);
* a task whose updates are outliers against the federation's (its |delta-b| near its bound
  while the others' are 10 times smaller; or, three rounds running, its |b_t| beyond 5
  times the others' median, or its b_t farther from the federation's consensus, the
  coordinate-wise median of the tasks' b_t, than the others' distances make plausible
  (median + 5 MADs, from 5 tasks on: :func:`~fmtl_flower.core.decoupling.consensus_fence`;
  what pulls the others is a coherent direction, not a size; a round in which the others
  catch up with it, its distance holding still while its multiple of the fence shrinks,
  does not count); or, with a learned Omega,
  its pull on the others, |b_t| times its coupling sum_s |M_st|, beyond 10 times the
  federation's median pull (:func:`~fmtl_flower.core.decoupling.coupling_weights`: the
  learned Sigma can give colluders under the other fences 10 to 20 times an honest task's
  weight in every model); all on the scale
  min(R~_t, median R~), :class:`~fmtl_flower.core.decoupling.OutlierWatch`) is decoupled
  from the others for the rest of the run (sticky; the statistics are re-checked every round
  and only add tasks): its off-diagonal entries of M are set to 0, so it no
  longer moves any other task's model, and the Omega-step of a learned formulation learns
  nothing from its model (:mod:`fmtl_flower.core.decoupling`). It keeps training its own
  model; W stays W(alpha) for the regulariser M'^-1 and every gap stays a true bound for it.
  Logged once per newly decoupled task; records list ``tasks_decoupled``. Both server
  paths: on the factored one (m > 1000 tasks) M' keeps its factored form
  (:func:`~fmtl_flower.core.decoupling.decoupled_factor`: the same M' as the dense path's,
  one more factor column per decoupled task) and the coupling weights, O(m^2 r / 2) flops,
  are computed once per M (after an Omega-step or a decoupling), not per round;
* weight shares (``max_weight_share``): no MOCHA-family average weights a device by what it
  reports. The mean formulation's mean and the sum of the per-task losses give every task
  1/m, whatever its ``n-train``, so the cap holds for m >= 1 / ``max_weight_share`` (and a
  cap below 1/m means equal weights, :func:`~fmtl_flower.core.robust.cap_shares`); a task
  that pulls harder than the others through its b_t is decoupled instead.

Round bookkeeping
-----------------
The metrics a node reports in round r describe the state *after* round r - 1 (the w_t it
received and its alpha after the commit), so record k (state after k rounds, k = 0 .. R) is
completed by round k + 1's replies, and record R by the final ``evaluate`` round. Primal, dual
and gap are reported only when every task reported for a consistent (W, alpha) pair; otherwise
they are None (``tasks_missing`` says which tasks were missing). Every record says
``gap_certified`` (true when it has a gap: every task's pair passed its check, no task
missing; the gap then bounds the suboptimality if the devices computed honestly) and
``certificate_rejections`` (how many of the replies that complete it failed the check);
``final`` adds ``certificate_rejections_total`` over the run.

Flower's ``Result``: ``train_metrics_clientapp[r]`` holds round r's ``num-replies``,
``num-dropped`` and ``num-sampled``; ``evaluate_metrics_clientapp[k]`` the numbers of record
k (primal, dual, gap, objective, test errors) for every evaluated state k (every
``eval_every`` rounds from k = 0, and the final one), taken from the train replies that
complete it, so no extra message is sent. ``fraction_train`` / ``min_train_nodes``
(:mod:`fmtl_flower.strategies.base`) sample the tasks that train in a round; the others are
sent ``dropped = true`` like a simulated drop-out: they do no local work but still report,
so W stays W(alpha) and the record's gap stays complete.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from logging import INFO, WARNING
from types import MappingProxyType
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from ..core.baselines import mbsdca_scale
from ..core.certificate import pair_problems
from ..core.decoupling import OutlierWatch, coupling_weights, federation_scale
from ..core.formulations import (
    make_formulation,
    options_check_size,
)
from ..core.losses import get_loss
from ..core.mocha import MOCHAServerState, omega_step_due
from ..core.mocha_factored import (
    FactoredMOCHAServerState,
    choose_server_path,
    make_server_state,
    restore_server_state,
)
from ..core.multiclass import (
    Lifting,
    canonical_classes,
    decide_classes,
    natural_binary,
    wire_list,
)
from ..core.record_dp import noise_norm_allowance, step_curvature
from ..metrics import round_record
from ..packing import StackGroup
from ..settings import MOCHASettings, apply_settings, check_num_tasks, drop_prob_of
from ..systems.heterogeneity import check_drop_prob, drop_mask, local_budgets
from ..systems.timing import deadline_budgets, round_time
from ..wire import (
    array_record,
    config_record,
    from_array,
    message,
    metric_record,
    plain_config,
    record_dict,
)
from .base import RUN_TOKEN_KEY, TaskStrategy, check_initial_dim, initial_model
from .discovery import (
    ReplyError,
    TaskDirectory,
    arrays_of,
    check_task_and_round,
    read_metrics,
)
from .faults import TaskHealth
from .linear_tasks import LinearTasks
from .packed_mocha import PROTOCOL as STACKING_PROTOCOL
from .packed_mocha import read_stacked_reply, stacked_message
from .records import RoundRecords
from .round_state import SentRound, SentRounds, drop_unsent, frozen_array
from .trust import (
    BOUND_SLACK,
    ReplyBoundary,
    ReplyContract,
    all_finite,
    guarded,
    norm,
)

RoundCallback = Callable[[dict[str, Any]], None]
#: What to do about a device refused for its labels (the end of its exclusion's reason).
CLASSES_FIX = ("the run's classes were decided at discovery from the devices' labels: map "
               "this device's labels to them, or raise mocha.max-classes (max_classes=)")
DUAL_METHODS = ("mocha", "cocoa", "mb-sdca")

#: What a reply may hold, by message type (the wire contract above; ``d``: the dimension).
REPLY_METRICS = ("task-id", "round", "n-train", "state-ok", "loss-mean", "dual-mean", "steps",
                 "test-errors", "test-n")
REPLY_CONTRACTS = {MessageType.TRAIN: ReplyContract.of(REPLY_METRICS, {"delta-b": ("d",)}),
                   MessageType.EVALUATE: ReplyContract.of(REPLY_METRICS)}
#: Why a task's accumulated dual image is bounded (robust mode; in a rejection's reason).
DUAL_IMAGE_BOUND = "b_t = X_t^T alpha_t / n_t with every |alpha_ti| <= 1"


class MOCHA(LinearTasks, TaskStrategy):
    """MOCHA: federated multi-task learning with a learned task-relationship matrix.

    Each task t (one device, or one node) learns a linear model w_t; the models are tied by the
    regulariser (lambda/2) tr(W Omega W^T). Rounds are primal-dual W-steps: every node runs
    SDCA on its local subproblem for a budget of coordinate steps and returns
    ``delta b_t = X_t^T d_alpha_t / n_t``; the server adds them to B and keeps
    W = B Sigma / lambda. Every ``omega_every`` rounds an Omega-step updates Sigma.

    The objective minimised is
    P(W) = sum_t mean_i l(y_ti x_ti^T w_t) + (lambda/2) tr(W Omega W^T)
    (per-task mean losses, summed over tasks, as in the authors' code), l the hinge by
    default (``loss``).

    Parameters
    ----------
    num_tasks : int or None
        Number of tasks (nodes) to wait for; task ids are 0 .. num_tasks - 1.
        None (the default): the distinct task ids of the nodes online once
        ``min_available_nodes`` are, counted when ``start`` runs (Flower's habit of sizing
        a run by its SuperNodes; :class:`~fmtl_flower.strategies.base.SizedAtStart`).
    lam : float
        Regularisation strength lambda > 0.
    omega : {"identity", "mean", "probabilistic", "clustered", "graphical"}
        The task-relationship formulation of the MOCHA paper's appendix B
        (:mod:`fmtl_flower.core.formulations`): fixed independent tasks, tasks pulled to their
        mean (eq. 11), the probabilistic Sigma = (W^T W + eps I)^(1/2) / trace (eq. 14),
        clustered tasks (eq. 12) or a sparse task graph by the graphical lasso (eq. 15).
    omega_every : int
        Rounds between Omega-steps (0: never; never after the last round).
    omega_eps : float
        Relative eigenvalue perturbation of the ``probabilistic`` Omega-step and of the
        ``graphical`` one with ``lam2 = 0`` (> 0), see
        :func:`fmtl_flower.core.omega.sigma_probabilistic`.
    lam2, s2, eta, clusters : optional
        Formulation parameters: ``mean``'s lambda2 (> 0), ``probabilistic``'s and
        ``graphical``'s s2 (the variance term I/s2; inf by default for ``probabilistic``,
        required for ``graphical``, whose penalty lam2 |Omega|_1 on every entry of Omega
        (>= 0) is also ``lam2``: the paper's lambda2, while ``lam`` is twice eq. (15)'s
        lambda), ``clustered``'s eta and number of clusters k.
    gamma : float
        Aggregation parameter in (0, 1] (appendix D.1): devices apply gamma * d_alpha and the
        server gamma * d_b; sigma' scales with gamma.
    method : {"mocha", "cocoa", "mb-sdca"}
        The local solver on the same primal-dual machinery: MOCHA's SDCA for a budget of
        steps; CoCoA's SDCA until the true local subproblem gap is <= ``theta`` times its
        value at the start (the budget is then a cap); or mini-batch SDCA at the stale model
        (at most n_t distinct samples), every update scaled by min(1, ``beta`` / b) with b the
        round's total number of steps (:mod:`fmtl_flower.core.baselines`).
    theta : float
        CoCoA's relative local accuracy, in (0, 1).
    beta : float
        Mb-SDCA's aggregation parameter (> 0).
    local_frac : float
        Local coordinate steps per round as a fraction of n_t (when ``sys_het="none"``).
    sigma_mode : {"global", "per-task", "spectral"}
        sigma' of Lemma 9 (one value), of Remark 5 (one per task), or the largest eigenvalue
        of D^-1/2 M D^-1/2 (one value, never above Lemma 9's). Lemma 9 bounds the dual's
        quadratic term only: it holds for every loss.
    loss : {"hinge", "smoothed-hinge", "logistic", "squared"}
        The loss l (:mod:`fmtl_flower.core.losses`); every method (MOCHA, CoCoA, Mb-SDCA)
        takes each.
    sys_het, sys_het_base : str
        Systems heterogeneity of the local budgets, see :mod:`fmtl_flower.systems`.
    drop_prob : float or sequence of float
        Probability that a node does no work in a round (simulated, seeded); one for every
        task, or one per task (p_t; 1.0 = a device that never sends).
    eval_every : int
        Rounds between test-error evaluations (the final model is always evaluated).
    network : {"wifi", "lte", "3g"}
        Link of the estimated-time model (:mod:`fmtl_flower.systems.timing`, eq. 30), which
        reports ``estimated_time_s`` per round: the slowest participating node's FLOPs / clock
        rate + communication.
    time_model : {"physical", "reference"}
        Network constants: measured link figures, or the reference code's cost units.
    clock_cycle : float, optional
        A per-round deadline in seconds: each node's budget is cut to what it can compute
        and send in time (stragglers do less instead of delaying the round).
    seed : int
        Seed of budgets, drops and the devices' coordinate orders.
    discovery_timeout : float
        Seconds to wait, at the first round, for ``num_tasks`` nodes to appear (at most
        ``start``'s ``timeout``; fewer than ``min_tasks`` raise ``DiscoveryError``).
    server_path : {"auto", "dense", "factored"}
        How the server keeps M = K^-1: an m x m matrix, or factored as V diag(s) V^T + c I
        (O(m d) memory; :mod:`fmtl_flower.core.mocha_factored`); ``auto`` factors when
        m > 1000 and m > 2 d. Both give the same numbers to rounding.
    min_replies : int
        A round counts only if at least this many tasks reply validly; otherwise no update is
        applied (the devices roll their changes back by the commit protocol) and the record
        says ``counted: false``. At most ``num_tasks`` (more is a configuration error).
    max_failures, probe_every : int
        A task whose device fails (error, rejected reply, or silence until the round's
        deadline) in ``max_failures`` consecutive rounds is excluded and only probed every
        ``probe_every`` rounds; it is readmitted when it answers or reconnects
        (:class:`~fmtl_flower.strategies.faults.TaskHealth`; ``max_failures=0``: never).
    max_row_norm : float, optional
        The bound R on every task's training-row norms used to check ``delta-b`` (module
        docstring); None: each task's ``max-row-norm`` reported at discovery.
    fit_intercept, intercept_scaling, max_classes : bool, float, int
        A penalised bias per task (and class) through a constant feature of value
        ``intercept_scaling`` the devices append; the most classes the devices' labels may
        make (module docstring, "Multi-class and intercept").
    dim : int, optional
        The feature dimension, when the configuration fixes it (None: the one a majority of
        the discovered nodes report, :class:`~fmtl_flower.strategies.discovery.TaskDirectory`).
    on_round : callable, optional
        Called with each completed round record (a dict), e.g. to print progress.
    settings : MOCHASettings, optional
        The parameters above and the common knobs (``min_tasks``, Flower's) as one checked object
        (:mod:`fmtl_flower.settings`); keyword arguments override it.

    Notes
    -----
    ``start(initial_arrays=ArrayRecord([W0]))`` (or ``ArrayRecord({"W": Array(W0)})``, or
    the numpy array ``W0`` itself), W0 of shape (d, m) or (d,) (one model broadcast to every
    task), seeds the run (all three methods). W is tied to the dual
    variables (W = W(alpha)), so W0 is not written into W: round 1 is a seeding round in which
    each device moves its alpha_t to the feasible dual point that best fits W0 (the dual
    objective over alpha_t with a proximity penalty toward W0's dual image,
    :mod:`fmtl_flower.clients.dual_seed`), without drops, sampling or solver steps; its record
    says ``seeded: true``. W after round 1 is W(alpha) near W0, every gap stays a true bound,
    and a W0 taken from a solved run restarts at its optimum. Tasks on packed nodes that speak
    the stacking protocol get their ``seed-w`` / ``seed-b`` as stacked rows and run the same
    seeding step: the run is bit for bit the unpacked one.
    """

    #: Settings this strategy derives its own value of (SettingsHome).
    derived_settings = frozenset({"drop_prob"})

    def __init__(self, num_tasks: int | None = None, settings: MOCHASettings | None = None,
                 *, dim: int | None = None, on_round: RoundCallback | None = None,
                 **kwargs: Any) -> None:
        s = MOCHASettings.resolve(settings, kwargs)
        self.settings = s
        if num_tasks is None:  # built by start, for the tasks online
            self.build_at_start(partial(MOCHA.__init__, self, settings=s,
                                        dim=dim, on_round=on_round), s)
            return
        m = check_num_tasks(num_tasks)
        self.formulation_options = s.formulation_options
        self.loss_fn = get_loss(s.loss)
        # validate the options on a small instance: the dense formulation is m x m
        make_formulation(s.omega, options_check_size(m, s.clusters), lam=s.lam,
                         **self.formulation_options)
        if s.method not in DUAL_METHODS:
            raise ValueError(f"method must be one of {DUAL_METHODS}, got {s.method!r}")
        choose_server_path(m, None, s.omega, s.server_path)  # early: path, size
        if s.min_replies > m:
            raise ValueError(f"min-replies (min_replies) = {s.min_replies} is larger than the "
                             f"number of tasks ({m}): no round could count")
        self.health = TaskHealth(m, max_failures=s.max_failures, probe_every=s.probe_every,
                                 name="MOCHA")
        self.num_tasks = m
        self.directory = TaskDirectory(m, "MOCHA", dim=dim)
        apply_settings(self, s)
        self.directory.max_classes = self.max_classes
        self.lifting = Lifting(None, self.intercept_scaling if self.fit_intercept else 0.0)
        self._lifting_fixed = False  # the class list is decided at the first discovery
        self.drop_prob = check_drop_prob(drop_prob_of(s.drop_prob), m)
        self.on_round = on_round
        self.round_timeout = 120.0
        self.num_rounds: int | None = None
        self.state: MOCHAServerState | FactoredMOCHAServerState | None = None
        self._round_time: tuple[tuple, float] | None = None  # eq. (30)'s last (inputs, time)
        self._constants: tuple[Any, ...] | None = None  # (state, formulation, mode, values)
        self.last_accepted = np.zeros(self.num_tasks, dtype=np.int64)
        self.ever_replied = np.zeros(self.num_tasks, dtype=bool)
        self.book = RoundRecords()  # one record per state (strategies/records.py)
        self.replies = ReplyBoundary("MOCHA", REPLY_CONTRACTS,
                                     lambda: {"d": self.model_dim})
        self.sent_rounds = SentRounds("MOCHA")  # each exchange's SentRound, until read
        self._round_start = 0.0
        self._checkpoint_n_train: np.ndarray | None = None
        self._seed_W: np.ndarray | None = None  # start()'s initial W0, until round 1
        self.watch = OutlierWatch(self.num_tasks)  # robust mode's decoupling, sticky

    @property
    def model_dim(self) -> int | None:
        """The dimension of each w_t: the devices' ``dim`` as the run's lifting makes it
        ((d + 1 with an intercept) * K for K > 2 classes; None until known)."""
        dim = self.directory.dim
        return None if dim is None else self.lifting.dim(dim)

    @property
    def n_train(self) -> np.ndarray:
        """Each task's number of (lifted) training samples: ``n-train`` of its whoami times
        K in a multi-class run (0: not seen yet)."""
        blocks = self.lifting.blocks
        return self.directory.n_train if blocks == 1 else self.directory.n_train * blocks

    def _lift_row_norms(self, norms: Any) -> Any:
        """Row norms of the devices' data as the run's lifting makes them (the intercept's
        constant feature adds to them, the class blocks do not)."""
        return self.lifting.row_norm(norms)

    @property
    def decoupled(self) -> np.ndarray:
        """The tasks robust mode decoupled (bool, (m,)), :mod:`fmtl_flower.core.decoupling`."""
        return self.watch.decoupled

    # ------------------------------------------------------------------ Strategy interface
    samples_devices = True
    #: Record-level DP (:func:`fmtl_flower.strategies.record_dp.enable_record_dp`), or None.
    privacy: Any = None

    @property
    def withholds_objective(self) -> bool:
        """Whether the devices withhold ``loss-mean`` and ``dual-mean`` (record-level DP):
        no primal, dual or gap is computed."""
        return self.privacy is not None

    def summary(self) -> None:
        """Log the configuration."""
        log(INFO, "\t├── MOCHA: %d tasks, lambda=%g, omega=%s every %d rounds, sigma'=%s, "
            "loss=%s", self.num_tasks, self.lam, self.omega, self.omega_every, self.sigma_mode,
            self.loss)
        log(INFO, "\t└── local-frac=%g, sys-het=%s (%s), drop-prob=%s, seed=%d",
            self.local_frac, self.sys_het, self.sys_het_base, self.drop_prob, self.seed)
        if self.fit_intercept:
            log(INFO, "\t    intercept: a constant feature %g on every device",
                self.intercept_scaling)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One ``train`` message per reachable task, with its w_t, m_tt, sigma' and budget.

        Everything the replies are checked against is fixed here, before the first message
        is made: the round's :class:`~fmtl_flower.strategies.round_state.SentRound`, kept
        in :attr:`sent_rounds` until :meth:`aggregate_train` reads the round's replies
        against it. The messages are then made from it one at a time as the grid takes
        them (a generator: the streaming in-process engine calls each device as soon as its
        message exists, and the m messages, each holding its w_t, are never all alive at
        once; the run loop hands a list to grids that do not stream,
        :func:`~.base.as_taken_by`)."""
        self._round_start = time.perf_counter()
        self.discover(grid, wait=server_round == self.first_round)
        if self.state is None:
            raise RuntimeError(
                "MOCHA found no usable node: check that the ClientApp is MOCHA's and that "
                "nodes report a task id (--node-config \"task-id=N\")")
        if len(self.records) < server_round:  # state before this round, completed by replies
            self._new_record(server_round - 1)
        chosen = self.health.select(server_round, self.task_to_node)
        work = self._round_work(server_round, chosen)
        if self.privacy is not None:  # record-level DP: every device sent work releases
            self._count_releases(work["budgets"], work["dropped"], chosen)
        evaluate = (server_round - 1) % self.eval_every == 0
        sent = self._send(server_round, MessageType.TRAIN, evaluate, chosen, grid, **work)
        return self._message_stream(sent)

    def _round_work(self, server_round: int, chosen: dict[int, int]) -> dict[str, Any]:
        """The work of a train round: the tasks' budgets and drop-outs (simulated drops,
        tasks not sampled), Mb-SDCA's scale, and in the seeding round the targets (W0, W0 K)
        with every task's budget n-train and no drop; as keywords of :meth:`_send`."""
        known = np.flatnonzero(self.n_train > 0)
        budgets = np.zeros(self.num_tasks, dtype=np.int64)
        budgets[known] = local_budgets(self._budget_sizes(known), local_frac=self.local_frac,
                                       sys_het=self.sys_het, base=self.sys_het_base,
                                       seed=self.seed, server_round=server_round)
        budgets[known] = deadline_budgets(budgets[known], self.clock_cycle, self.state.dim,
                                          self.method, self.network, model=self.time_model,
                                          n=self.n_train[known] if self.method == "cocoa"
                                          else None, loss=self.loss_fn)
        dropped = drop_mask(self.num_tasks, self.drop_prob, seed=self.seed,
                            server_round=server_round)
        sampled = self.sample_train_tasks(chosen, server_round, self.seed)
        if len(sampled) < len(chosen):  # fraction_train: the others sit the round out
            resting = np.ones(self.num_tasks, dtype=bool)
            resting[sampled] = False
            dropped = dropped | resting
        work: dict[str, Any] = {"num_sampled": len(sampled), "scale": 1.0,
                                "seed_targets": None}
        if self.method == "mb-sdca":  # distinct samples; s = min(1, beta / total steps)
            budgets = np.minimum(budgets, self.n_train)
            work["scale"] = mbsdca_scale(self.beta, int(budgets[~dropped].sum()))
        if self._seed_W is not None and server_round == 1:  # the seeding round
            work["seed_targets"] = self._seeding_targets()
            budgets = self.n_train.astype(np.int64)  # bounds |delta-b| by max-row-norm
            dropped = np.zeros(self.num_tasks, dtype=bool)
            work["num_sampled"] = len(chosen)
        work.update(budgets=budgets, dropped=dropped)
        return work

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord]:
        """Validate replies, complete the previous state's record, add delta b to B."""
        assert self.state is not None
        sent = self.sent_rounds.take(MessageType.TRAIN, server_round)
        if sent is None:
            drop_unsent(self.replies, MessageType.TRAIN, server_round, replies)
            return None, metric_record({"num-replies": 0, "num-dropped": self.num_tasks,
                                        "num-sampled": 0})
        accepted = self._read_replies(sent, replies)
        completed = self._complete_record(server_round - 1, accepted)
        if sent.evaluate and accepted:  # the test errors of state r - 1 came along
            self.report_evaluation(server_round - 1, completed, accepted)
        self.health.update(server_round, sent.exchange.sent.values(), accepted)
        counted = len(accepted) >= self.min_replies
        if not counted:
            log(WARNING, "MOCHA round %d does not count: %d valid replies, fewer than "
                "min-replies = %d; no update applied", server_round, len(accepted),
                self.min_replies)
            accepted = {}
        order = sorted(accepted)
        tasks = np.array(order, dtype=np.int64)
        resets = np.array([t for t in order if not accepted[t]["state-ok"]], dtype=np.int64)
        if len(resets):
            log(WARNING, "MOCHA round %d: task%s %s reset (b_t = 0): the device replied "
                "state-ok 0, it restarted from alpha = 0 (new device, lost or mismatched "
                "state)", server_round, "s" if len(resets) > 1 else "",
                ", ".join(str(t) for t in resets[:20]))
        saved_B = self.state.B[:, tasks].copy()
        self.state.reset_tasks(resets)
        if len(tasks):
            self.state.add_updates(tasks, np.stack([accepted[t]["delta-b"] for t in order], 1))
            if not all_finite(self.state.W):  # the bounds make this unreachable: belt and braces
                log(WARNING, "MOCHA round %d: the update left W non-finite; rolled back, the "
                    "replies of tasks %s rejected", server_round, tasks.tolist()[:20])
                self.state.B[:, tasks] = saved_B
                self.state.recompute_models()
                tasks = resets = tasks[:0]
            self.last_accepted[tasks] = server_round
        if self.privacy is not None:  # the noise now in B, for the Omega-step to discount
            self.privacy.note_accepted(self.num_tasks, tasks, resets,
                                       self._release_std(sent, tasks))
        if self.robust and len(tasks):
            self._decouple_outliers(sent, tasks, accepted)
        omega_step = omega_step_due(server_round, self.omega_every, self.num_rounds)
        if omega_step:
            omega_step = self._omega_step(server_round)
        record = self._new_record(server_round)
        if sent.seed_targets is not None:
            record["seeded"] = True  # round 1 moved the duals to initial_arrays' W0
            self._seed_W = None
        updated = tasks[~sent.dropped[tasks]] if len(tasks) else tasks
        record.update(num_replies=len(tasks), num_dropped=self.num_tasks - len(updated),
                      num_resets=len(resets), omega_step=omega_step, counted=counted,
                      tasks_excluded=[int(t) for t in np.flatnonzero(self.health.excluded)],
                      estimated_time_s=self._estimated_time(accepted, sent),
                      wall_time_s=time.perf_counter() - self._round_start)
        if self.robust:
            record["tasks_decoupled"] = [int(t) for t in np.flatnonzero(self.decoupled)]
        metrics = metric_record({"num-replies": len(tasks),
                                 "num-dropped": record["num_dropped"],
                                 "num-sampled": sent.num_sampled})
        return array_record({"W": self.state.W}), metrics

    def _count_releases(self, budgets: np.ndarray, dropped: np.ndarray,
                        chosen: dict[int, int]) -> None:
        """Record-level DP: one release for every task sent a train message with work (not
        ``dropped``, budget > 0), counted when sent (a lost reply was released too)."""
        released = np.zeros(self.num_tasks, dtype=bool)
        released[list(chosen)] = True
        released &= (budgets > 0) & ~dropped
        self.privacy.resolve(self.num_rounds or 1, self.num_tasks)
        self.privacy.count(released)

    def _row_norms(self, tasks: np.ndarray) -> np.ndarray:
        """R_t (:meth:`~.linear_tasks.LinearTasks._row_norms`), at most ``dp.clip`` under
        record-level DP (the devices clip their rows, intercept included)."""
        norms = super()._row_norms(tasks)
        return norms if self.privacy is None else np.fmin(norms, self.privacy.clip)

    def _noise_allowance(self, sent: SentRound, tasks: np.ndarray,
                         releases: Any = None) -> np.ndarray:
        """Record-level DP: what the noise may add to the norm of ``tasks``' delta-b: the
        round ``sent``'s release (the step-bounded noise the devices drew, at the w_t, m_tt
        and sigma' sent), or with ``releases`` that many of the largest (box-bounded); 0
        without DP."""
        if self.privacy is None:
            return np.zeros(len(tasks))
        if releases is None:
            return noise_norm_allowance(self._release_std(sent, tasks), self.state.dim)
        return self.privacy.allowance(self.n_train[tasks], self.state.dim,
                                      self.loss_fn.dual_radius, self._dp_scale(sent),
                                      self.lifting.blocks, releases)

    def _dp_scale(self, sent: SentRound) -> float:
        return self.gamma * (sent.scale if self.method == "mb-sdca" else 1.0)

    def _release_std(self, sent: SentRound, tasks: np.ndarray) -> np.ndarray:
        """Record-level DP: the noise std (per coordinate) of ``tasks``' release in the
        round ``sent``: the step-bounded one the devices drew, at the w_t, m_tt and sigma'
        sent."""
        if len(tasks) == 0:
            return np.zeros(0)
        n = self.n_train[tasks]
        count = np.minimum(sent.budgets[tasks], n)
        curvature = np.array([step_curvature(self.method, m, s, int(b)) for m, s, b in
                              zip(sent.m_diag[tasks].tolist(),
                                  sent.sigma_prime[tasks].tolist(),
                                  count.tolist(), strict=True)])
        steps = (self.loss_fn.name, curvature, sent.w_norm[tasks])
        return self.privacy.noise_std(n, self.loss_fn.dual_radius, self._dp_scale(sent),
                                      self.lifting.blocks, steps)

    def _decouple_outliers(self, sent: SentRound, tasks: np.ndarray,
                           accepted: dict[int, dict[str, Any]]) -> None:
        """Robust mode: decouple (sticky) the tasks whose updates are outliers against the
        federation's (:class:`~fmtl_flower.core.decoupling.OutlierWatch`), on the budgets
        ``sent``, logging each newly decoupled task once."""
        assert self.state is not None
        server_round = sent.server_round
        scale = federation_scale(self._row_norms(np.arange(self.num_tasks)))
        budget = sent.work(np.arange(self.num_tasks))
        n = np.maximum(self.n_train, 1)
        delta = np.zeros(self.num_tasks)
        delta[tasks] = norm(np.stack([accepted[t]["delta-b"] for t in tasks.tolist()]), axis=1)
        updated = np.zeros(self.num_tasks, dtype=bool)
        updated[tasks] = ~sent.dropped[tasks]
        new = self.watch.update(delta, scale * np.minimum(budget, n) / n,
                                norm(self.state.B, axis=0), scale, updated,
                                images=self.state.B, coupling=self._coupling())
        if not new.any():
            return
        self.state.decouple(self.decoupled)
        self._constants = None  # M changed: m_tt and sigma' are recomputed
        log(WARNING, "MOCHA round %d: task%s %s decoupled from the others (off-diagonal "
            "coupling in M set to 0 for the rest of the run): %s", server_round,
            "s" if new.sum() > 1 else "", np.flatnonzero(new).tolist()[:20],
            "their updates are outliers against the federation's (robust mode)")

    def _coupling(self) -> np.ndarray | None:
        """The coupling weights of the current M' (learned formulations,
        :func:`~fmtl_flower.core.decoupling.coupling_weights`; the factored state caches
        them per M): under a fixed Omega every pair is coupled alike and a task's pull is
        its image's size, fenced already."""
        state = self.state
        if state is None or state.formulation.fixed:
            return None
        if isinstance(state, FactoredMOCHAServerState):
            return state.coupling_weights()
        return coupling_weights(state.M)

    def _omega_step(self, server_round: int) -> bool:
        """The Omega-step, undone (Omega, M and W kept) if it raises or leaves W or M
        non-finite; whether it stood."""
        state = self.state
        assert state is not None
        dense = isinstance(state, MOCHAServerState)
        step = state.omega_step if self.privacy is None else \
            (lambda: self.privacy.omega_step(state))
        reason = guarded(step, (state, state.formulation),
                         lambda: all_finite(state.W, *((state.M,) if dense else ())))
        if reason is not None:
            log(WARNING, "MOCHA round %d: the Omega-step failed (%s); undone, Omega kept",
                server_round, reason)
        return reason is None

    def _estimated_time(self, accepted: dict[int, dict[str, Any]], sent: SentRound) -> float:
        """Eq. (30): the round lasts as long as its slowest replying node (or the deadline).

        A node whose reply never came kept the server waiting: the round then lasts the
        deadline (``clock_cycle``) if one is set, else the round timeout.
        """
        assert self.state is not None
        steps = np.array([accepted[t].get("steps", 0) for t in accepted], dtype=np.int64)
        n = self.n_train[list(accepted)] if self.method == "cocoa" else None
        # the same steps (and settings) as the last round's give the same time: computed once
        key = (steps.tobytes(), None if n is None else n.tobytes(), self.state.dim,
               self.method, id(self.network), self.time_model, self.clock_cycle,
               self.loss_fn.name)
        if self._round_time is not None and self._round_time[0] == key:
            t_round = self._round_time[1]
        else:
            t_round = round_time(steps, self.state.dim, self.method, self.network,
                                 clock_cycle=self.clock_cycle, model=self.time_model, n=n,
                                 loss=self.loss_fn)
            self._round_time = (key, t_round)
        if len(accepted) < len(sent.exchange.sent):
            t_round = self.clock_cycle if self.clock_cycle is not None else self.round_timeout
        return float(t_round)

    def _final_instructions(self, server_round: int, grid: Grid) -> Iterable[Message]:
        if self.state is None:
            return []
        return self._message_stream(self._send(server_round, MessageType.EVALUATE, True,
                                               dict(self.task_to_node), grid))

    def _final_replies(self, server_round: int,
                       replies: Iterable[Message]) -> dict[int, dict[str, Any]]:
        sent = self.sent_rounds.take(MessageType.EVALUATE, server_round)
        if sent is None:
            drop_unsent(self.replies, MessageType.EVALUATE, server_round, replies)
            return {}
        return self._read_replies(sent, replies)

    # ------------------------------------------------------------------ checkpoints
    def fingerprint(self) -> dict[str, Any]:
        """Settings a checkpoint must share with this run to be resumed (the loss when it is
        not the hinge: B is the image of duals of one loss; hinge checkpoints written before
        the loss family existed stay resumable; the intercept's scaling when one is fitted)."""
        out = {"strategy": "MOCHA", "num_tasks": self.num_tasks, "lam": self.lam,
               "omega": self.omega, "formulation": self.formulation_options,
               "method": self.method, "seed": self.seed, "server_path": self.server_path}
        if self.loss != "hinge":
            out["loss"] = self.loss
        if self.fit_intercept:
            out["intercept_scaling"] = self.lifting.intercept_scaling
        if self.privacy is not None:
            out["dp"] = self.privacy.fingerprint()
        return out

    def checkpoint_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """B, W, M, the formulation's Omega, per-task bookkeeping, records, health and (robust
        mode) the decoupling watch's streaks and last values (``OutlierWatch.state_arrays``)."""
        assert self.state is not None
        health_arrays, health_meta = self.health.state()
        arrays = {**{f"state.{k}": v for k, v in self.state.state_arrays().items()},
                  **{f"health.{k}": v for k, v in health_arrays.items()},
                  "last_accepted": self.last_accepted, "n_train": self.n_train}
        if self.robust:
            arrays.update(self.watch.state_arrays())
        if self.privacy is not None:
            arrays.update(self.privacy.state_arrays())
        meta: dict[str, Any] = {"records": self.book.to_meta(), "health": health_meta}
        if self.lifting.classes is not None:
            meta["classes"] = wire_list(self.lifting.classes)
        return arrays, meta

    def restore_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Load :meth:`checkpoint_state`'s output (the run's other settings must match)."""
        def part(prefix: str) -> dict[str, np.ndarray]:
            return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
        self.state = restore_server_state(part("state."), self.num_tasks, self.omega,
                                          lam=self.lam, **self.formulation_options)
        classes = meta.get("classes")
        self.lifting = Lifting(None if classes is None else canonical_classes(classes),
                               self.lifting.intercept_scaling)
        self._lifting_fixed = True
        self.directory.fix_labels(self._allowed_classes(), {}, CLASSES_FIX)
        self.directory.dim = self.state.dim // self.lifting.blocks \
            - (self.lifting.intercept_scaling > 0)
        self.health.restore(part("health."), meta["health"])
        for key in ("last_accepted", "n_train"):
            if arrays[key].shape != (self.num_tasks,):
                raise ValueError(f"checkpoint {key!r} must have shape ({self.num_tasks},)")
        self.last_accepted = arrays["last_accepted"].astype(np.int64)
        if self.privacy is not None:  # the account resumes
            self.privacy.restore(arrays, self.num_tasks)
        self.watch.restore(arrays)
        if self.decoupled.any():
            self.state.decoupled = self.decoupled.copy()  # M stored is M'
        self._checkpoint_n_train = arrays["n_train"].astype(np.int64)
        self.book.load(meta["records"])

    def results(self) -> dict[str, Any]:
        """The results contract, plus ``health``: which task missed which rounds, on which
        node, and the exclusions and readmissions (node ids are the engine's, so they live
        outside ``final``); ``final`` adds ``certificate_rejections_total``, the replies of
        the whole run that failed the certificate's check."""
        out = super().results()
        out["final"]["certificate_rejections_total"] = sum(
            r.get("certificate_rejections", 0) for r in out["rounds"])
        out["health"] = self.health.summary(self.task_to_node)
        if self.privacy is not None:
            out["privacy"] = {"mechanism": "record", "delta": self.privacy.settings.delta,
                              "noise_multiplier": self.privacy.noise_multiplier,
                              "clip": self.privacy.clip,
                              "epsilon_per_task": self.privacy.epsilons()}
        return out

    # ------------------------------------------------------------------ initial_arrays
    def seed_model(self, initial_arrays: ArrayRecord) -> None:
        """Take ``initial_arrays`` = ``ArrayRecord([W0])`` (one array, unnamed or ``"W"``), W0
        of shape (d, m) or (d,) (one model for every task), as the start: round 1 becomes the
        seeding round, in which every reachable device moves its duals to the feasible point
        nearest W0 in the sense of
        :mod:`fmtl_flower.clients.dual_seed` (no solver steps, no drops or sampling; W stays
        W(alpha), so every gap stays valid). Shape and finiteness are checked here, d against
        the nodes' ``dim`` at discovery."""
        if len(initial_arrays) == 0:
            return
        if self.privacy is not None:
            raise ValueError("record-level DP does not cover the seeding round of "
                             "initial_arrays (its step is not separable): start without it")
        self._seed_W = initial_model(initial_arrays, "W", self.num_tasks, "MOCHA",
                                     None if self.state is None else self.state.dim)

    def _seeding_targets(self) -> tuple[np.ndarray, np.ndarray]:
        """(W0, B0 = W0 K) for the seeding round, K = M^-1 of the starting Omega."""
        assert self.state is not None and self._seed_W is not None
        W0 = self._seed_W
        if W0.ndim == 1:
            W0 = np.repeat(W0[:, None], self.num_tasks, axis=1)
        formulation = self.state.formulation
        factor = getattr(formulation, "regulariser_factor", None)
        B0 = factor().right_multiply(W0) if callable(factor) \
            else W0 @ formulation.regulariser_matrix()
        return W0, B0

    # ------------------------------------------------------------------ discovery
    def discover(self, grid: Grid, wait: bool = False) -> None:
        """Map new node ids to tasks (``whoami``); create the state once ``dim`` is known."""
        self.directory.discover(grid, wait=self.discovery_timeout if wait else 0.0,
                                query_timeout=max(self.round_timeout, 60.0))
        if not self._lifting_fixed and self.directory.dim is not None:
            self._fix_lifting()
        if self.state is None and self.directory.dim is not None:
            self.state = make_server_state(self.model_dim, self.num_tasks, self.omega,
                                           lam=self.lam, path=self.server_path,
                                           **self.formulation_options)
        if self._seed_W is not None and self.state is not None:
            check_initial_dim(self._seed_W, self.state.dim, "W", "MOCHA")
        if self._checkpoint_n_train is not None:  # resumed: a task whose data changed restarts
            known = self.n_train > 0
            changed = np.flatnonzero(known & (self.n_train != self._checkpoint_n_train))
            if len(changed) and self.state is not None:
                log(WARNING, "MOCHA: tasks %s report another n-train than at the checkpoint; "
                    "reset (b_t = 0, alpha_t = 0)", changed.tolist())
                self.state.reset_tasks(changed)
                self.last_accepted[changed] = 0
            self._checkpoint_n_train[known] = self.n_train[known]

    def _fix_lifting(self) -> None:
        """Decide the run's class list from the devices' ``classes`` (one vote per physical
        node, :func:`~fmtl_flower.core.multiclass.decide_classes`): none reported, or the
        binary labels {-1, +1} / {0, 1}, keep today's binary problem; two other labels are
        binary too (c_0 -> -1, c_1 -> +1); more make the one-vs-rest lifting. Logged; the
        nodes refused and those whose labels lie outside the list are excluded."""
        votes = self.directory.labels_by_node()
        classes, refused = decide_classes(votes, self.robust, self.max_classes)
        if votes:
            counts = sorted({len(v) for v in votes.values()})
            log(INFO, "MOCHA: %d classes %s, decided by the %d nodes that reported their "
                "labels (class counts %s)%s", len(classes), list(classes)[:20], len(votes),
                counts, f"; refused: {refused}" if refused else "")
        if len(classes) == 1 and not natural_binary(classes):
            log(WARNING, "MOCHA: the devices hold one class only (%r); a classifier needs "
                "two: their messages will fail", classes[0])
        lifted = None if not classes or natural_binary(classes) else classes
        self.lifting = Lifting(lifted, self.lifting.intercept_scaling)
        self._lifting_fixed = True
        if votes:
            self.directory.fix_labels(self._allowed_classes(classes), refused, CLASSES_FIX)

    @property
    def classes(self) -> tuple[Any, ...] | None:
        """The run's classes once decided at discovery (None before): the agreed sorted
        class list, or for the binary labels the pair they belong to, (-1, 1) or (0, 1)."""
        return self._allowed_classes() if self._lifting_fixed else None

    def _allowed_classes(self, classes: Iterable[Any] | None = None) -> tuple[Any, ...]:
        """The labels a device may hold in this run: the class list, or for the binary
        labels both of the pair they belong to."""
        chosen = tuple(classes if classes is not None else self.lifting.classes or ())
        if not chosen or natural_binary(chosen):
            return (-1, 1) if set(chosen) <= {-1, 1} else (0, 1)
        return chosen

    # ------------------------------------------------------------------ messages
    def _send(self, server_round: int, message_type: str, evaluate: bool,
              chosen: dict[int, int], grid: Grid | None = None, *,
              budgets: np.ndarray | None = None, dropped: np.ndarray | None = None,
              scale: float = 1.0, seed_targets: tuple[np.ndarray, np.ndarray] | None = None,
              num_sampled: int = 0) -> SentRound:
        """Fix what an exchange sends, as a :class:`~.round_state.SentRound` kept in
        :attr:`sent_rounds` and registered with the trust boundary (:meth:`ReplyBoundary.
        begin`): the w_t, the config every message shares (built once, for the one-task and
        the stacked messages), the per-task values and the inputs of the replies' bounds;
        the tasks on packed nodes that speak MOCHA's stacking protocol go as one stacked
        message per node (:mod:`~fmtl_flower.strategies.packed_mocha`). ``budgets`` None:
        no work (the evaluate exchange)."""
        assert self.state is not None
        if self.privacy is not None:  # the noise multiplier, fixed at the first message
            self.privacy.resolve(self.num_rounds or 1, self.num_tasks)
        m_diag, sigma_p = self._task_constants()
        W = self.state.W
        stacks: list[StackGroup] = []
        stacked_groups = getattr(grid, "stacked_groups", None)
        if callable(stacked_groups):
            stacks, chosen = stacked_groups(STACKING_PROTOCOL, chosen)
        if dropped is None:
            dropped = np.zeros(self.num_tasks, dtype=bool)
        sent = SentRound(
            server_round, message_type, bool(evaluate),
            MappingProxyType(self._shared_config(evaluate, budgets is not None, scale)),
            models=frozen_array(W.T), w_norm=frozen_array(norm(W, axis=0)),
            budgets=None if budgets is None else frozen_array(budgets, np.int64),
            dropped=frozen_array(dropped, np.bool_),
            w_dot_b=frozen_array(np.einsum("ij,ij->j", W, self.state.B)),
            m_diag=m_diag, sigma_prime=sigma_p,
            last_accepted=frozen_array(self.last_accepted, np.int64), scale=scale,
            seed_targets=None if seed_targets is None
            else tuple(frozen_array(t) for t in seed_targets),
            chosen=MappingProxyType(dict(chosen)), stacks=tuple(stacks),
            num_sampled=num_sampled, exchange=self.replies.begin())
        return self.sent_rounds.add(sent)

    def _shared_config(self, evaluate: bool, with_work: bool, scale: float) -> dict[str, Any]:
        """The config entries every message of an exchange shares (the stacked messages add
        ``server-round``); ``with_work``: a train exchange (the method's entries)."""
        shared: dict[str, Any] = {"seed": self.seed, "eval": bool(evaluate),
                                  RUN_TOKEN_KEY: self.sent_identity, **self.lifting.config()}
        if self.gamma != 1.0:
            shared["gamma"] = self.gamma
        if self.loss != "hinge":
            shared["loss"] = self.loss
        if self.checkpoint_dir is not None:
            shared["checkpoint-round"] = self.last_checkpoint_round
        if self.privacy is not None:
            shared.update(self.privacy.wire_config())
        if self.method != "mocha" and with_work:
            shared["method"] = self.method
            if self.method == "cocoa":
                shared["theta"] = self.theta
            else:
                shared["scale"] = scale
        return shared

    def _task_constants(self) -> tuple[np.ndarray, np.ndarray]:
        """(m_tt, sigma'_t) of the current M, read-only: computed once while the state and
        its formulation stay the same objects and the formulation is fixed (its M never
        changes), else every round."""
        assert self.state is not None
        state, formulation = self.state, self.state.formulation
        kept = self._constants
        if kept is not None and kept[0] is state and kept[1] is formulation \
                and kept[2] == self.sigma_mode:
            return kept[3]
        values = (state.m_diag(), state.sigma_prime(self.sigma_mode))
        for array in values:
            array.setflags(write=False)
        self._constants = (state, formulation, self.sigma_mode, values) \
            if formulation.fixed else None
        return values

    def _message_stream(self, sent: SentRound) -> Iterator[Message]:
        """The messages of ``sent``, made from it alone, one at a time: one stacked message
        per packed node, then one message per task, each registered with ``sent``'s
        exchange."""
        server_round, message_type = sent.server_round, sent.message_type
        if sent.stacks:
            shared = {"server-round": server_round, **sent.config}
            per_task = sent.stacked_vectors()
            W = sent.models.T
            for group in sent.stacks:
                yield sent.exchange.track_stack(group, stacked_message(
                    group, message_type, server_round, shared, W, per_task))
        if not sent.chosen:
            return
        shared = sent.config
        # Python numbers, read once per round (the tasks' w_t as contiguous rows)
        last_accepted = sent.last_accepted.tolist()
        m_tt, sigma = sent.m_diag.tolist(), sent.sigma_prime.tolist()
        budget = None if sent.budgets is None else sent.budgets.tolist()
        dropped = sent.dropped.tolist()
        rows = sent.models
        seeding = sent.seed_targets is not None and budget is not None
        group = str(server_round)
        # the per-task values below are Python numbers (tolist): checked once, not per message
        plain = plain_config(shared) and type(server_round) is int
        for task, node in sorted(sent.chosen.items()):
            config = {"task-id": task, "server-round": server_round,
                      "last-accepted-round": last_accepted[task], "m-tt": m_tt[task],
                      "sigma-prime": sigma[task], **shared}
            if budget is not None:
                config["budget"] = budget[task]
                config["dropped"] = dropped[task]
            arrays = {"w": rows[task]}
            if seeding:
                arrays["seed-w"] = np.ascontiguousarray(sent.seed_targets[0][:, task])
                arrays["seed-b"] = np.ascontiguousarray(sent.seed_targets[1][:, task])
            content = record_dict({"arrays": array_record(arrays), "config": config_record(
                config, handed_over=plain and type(task) is int)}, handed_over=True)
            yield sent.exchange.track(task, node, message(content, node, message_type, group))

    def _read_replies(self, sent: SentRound,
                      replies: Iterable[Message]) -> dict[int, dict[str, Any]]:
        """Validated replies to the exchange ``sent``, keyed by task, in task order, each
        checked against what ``sent`` holds; anything invalid is logged and left out
        (:class:`~fmtl_flower.strategies.trust.ReplyBoundary`, reading against ``sent``'s
        exchange; a stacked reply per row, :meth:`_parse_stack`)."""
        def on_accept(task: int) -> None:
            self.ever_replied[task] = True

        server_round, with_delta = sent.server_round, sent.with_work
        return self.replies.read(
            f"round {server_round}", replies,
            lambda reply, task: self._parse_reply(reply, task, server_round, with_delta),
            on_accept,
            lambda reply, group: self._parse_stack(reply, group, server_round, with_delta),
            lambda rows: self._check_rows(rows, sent), exchange=sent.exchange).accepted

    def _parse_stack(self, reply: Message, group: StackGroup, server_round: int,
                     with_delta: bool) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
        """The rows of a stacked reply as :meth:`_parse_reply` gives one reply's values, and
        the rejected tasks with their reasons (checked in vectorised form; the bounds that
        need R_t are :meth:`_check_rows`', which ``ReplyBoundary.read`` applies to them)."""
        assert self.state is not None
        return read_stacked_reply(reply, group, server_round, self.n_train, self.state.dim,
                                  with_delta, self.directory.max_n)

    def _parse_reply(self, reply: Message, task: int, server_round: int,
                     with_delta: bool) -> dict[str, Any]:
        """One reply's keys, types, shapes and finite metrics, its task and round, and the
        bounds that need no R_t; ``delta-b``'s values, the R_t bounds and the certificate's
        check of the loss and dual are :meth:`_check_rows`' (all replies at once)."""
        assert self.state is not None
        out = read_metrics(reply, ints=("task-id", "round", "n-train", "state-ok"),
                           numbers=("loss-mean", "dual-mean"),
                           optional_ints=("test-errors", "test-n", "steps"))
        if out.get("steps", 0) < 0:
            raise ReplyError(f"steps must be >= 0, got {out['steps']}")
        if out["state-ok"] not in (0, 1):
            raise ReplyError(f"state-ok must be 0 or 1, got {out['state-ok']}")
        check_task_and_round(out, task, server_round)
        if out["n-train"] != self.n_train.item(task):
            raise ReplyError(f"n-train {out['n-train']} differs from {self.n_train[task]}")
        self._check_tests(out)
        if with_delta:
            arrays = arrays_of(reply)
            if arrays is None or "delta-b" not in arrays:
                raise ReplyError("array 'delta-b' missing")
            delta = from_array(arrays["delta-b"])
            if delta.dtype != np.float64 or delta.shape != (self.state.dim,):
                raise ReplyError(f"'delta-b' must be float64 of shape ({self.state.dim},), "
                                 f"got {delta.dtype} {delta.shape}")
            out["delta-b"] = delta  # finite or not: :meth:`_check_rows` looks at every row
        return out

    def _check_rows(self, rows: dict[int, dict[str, Any]], sent: SentRound) -> dict[int, str]:
        """The bounds of the module docstring over parsed replies ``rows`` (the one-task
        replies of a round, or the valid rows of a stacked reply) to the exchange ``sent``,
        against what it sent (|w_t|, w_t . b_t, budgets, drop-outs), vectorised: the
        rejected tasks with their reasons. Checked in this order, a reply keeping the first
        reason:
        non-finite values in ``delta-b``, no R_t, ``loss-mean``
        (:meth:`~.linear_tasks.LinearTasks._bound_rows`), the certificate's check of the
        (``loss-mean``, ``dual-mean``) pair (:meth:`_check_pairs`), ``|delta-b|``."""
        tasks = np.fromiter(rows, dtype=np.int64, count=len(rows))
        rejected: dict[int, str] = {}
        with_delta = sent.with_work
        if with_delta:
            deltas = np.stack([rows[t]["delta-b"] for t in tasks.tolist()])
            for task in tasks[~np.isfinite(deltas).all(axis=1)].tolist():
                rejected[task] = "'delta-b' has non-finite values"
        bound = self._bound_rows(rows, tasks, rejected, sent.w_norm)
        if self.privacy is None:  # record-level DP: the devices withhold the pair
            self._check_pairs(rows, tasks, rejected, sent.w_dot_b)
        if not with_delta:
            return rejected
        n = self.n_train[tasks]
        budget = sent.work(tasks)
        size = norm(deltas, axis=1)
        limit = self._dual_limit(bound * np.minimum(budget, n) / n) \
            + np.where(budget > 0, self._noise_allowance(sent, tasks), 0.0)
        for i in np.flatnonzero(~(size <= limit * BOUND_SLACK)).tolist():
            rejected.setdefault(int(tasks[i]), (
                f"|delta-b| = {size[i]:.6g} above its bound {limit[i]:.6g} (max-row-norm "
                f"{bound[i]:g} x min(budget {budget[i]}, n-train {n[i]}) / n-train)"))
        if self.robust:
            self._check_dual_images(rows, tasks, deltas, bound, rejected, sent)
        return rejected

    def _check_pairs(self, rows: dict[int, dict[str, Any]], tasks: np.ndarray,
                     rejected: dict[int, str], w_dot_b: np.ndarray) -> None:
        """The certificate's check of every row's (``loss-mean``, ``dual-mean``) against
        ``w_dot_b``, w_t . b_t as the server held them when it sent w_t
        (:func:`~fmtl_flower.core.certificate.hinge_pair_problems`: the dual box, and
        Fenchel-Young's
        loss-mean - dual-mean + w_t . b_t >= 0; a device that restarted from alpha = 0 has
        b_t = 0 on its side). Adds the failures to ``rejected`` (a task already there keeps
        its reason). Always on: an honest pair never fails it, and with every pair passing
        the record's gap is >= 0 (proof in :mod:`fmtl_flower.core.certificate`)."""
        order = tasks.tolist()
        loss = np.array([rows[t]["loss-mean"] for t in order], dtype=np.float64)
        dual = np.array([rows[t]["dual-mean"] for t in order], dtype=np.float64)
        kept = np.array([rows[t]["state-ok"] == 1 for t in order], dtype=bool)
        coupling = np.where(kept, w_dot_b[tasks], 0.0)
        for i, reason in pair_problems(self.loss_fn, loss, dual, coupling).items():
            rejected.setdefault(order[i], reason)

    def _dual_limit(self, unit: np.ndarray) -> np.ndarray:
        """A bound on |X^T alpha / n| from its value ``unit`` for |alpha_i| <= 1: times the
        loss's dual radius (1 for the hinge, smoothed hinge and logistic loss; inf for the
        squared loss, where only a 0 bound stays 0; NaN stays NaN: no R_t)."""
        radius = self.loss_fn.dual_radius
        if radius == 1.0:
            return unit
        with np.errstate(invalid="ignore"):
            return np.where(unit == 0.0, 0.0, unit * radius)

    def _check_dual_images(self, rows: dict[int, dict[str, Any]], tasks: np.ndarray,
                           deltas: np.ndarray, bound: np.ndarray,
                           rejected: dict[int, str], sent: SentRound) -> None:
        """Robust mode: the dual image a reply would leave, b_t + delta-b (from 0 after a
        restart, ``state-ok`` 0), within R~_t (:data:`DUAL_IMAGE_BOUND`); adds the broken
        replies to ``rejected``."""
        assert self.state is not None
        restarted = np.array([not rows[t]["state-ok"] for t in tasks.tolist()])
        start = self.state.B[:, tasks].T.copy()
        start[restarted] = 0.0
        size = norm(start + deltas, axis=1)
        limit = self._dual_limit(bound) + (0.0 if self.privacy is None else
                                           self._noise_allowance(sent, tasks,
                                                                 self._releases(tasks)))
        for i in np.flatnonzero(~(size <= limit * BOUND_SLACK)).tolist():
            rejected.setdefault(int(tasks[i]), (
                f"|b_t + delta-b| = {size[i]:.6g} above max-row-norm {bound[i]:g} "
                f"({DUAL_IMAGE_BOUND})"))

    def _releases(self, tasks: np.ndarray) -> np.ndarray:
        """Record-level DP: the releases counted so far for ``tasks`` (at least 1)."""
        counts = self.privacy.accountant.counts
        return np.maximum(counts[tasks] if len(counts) else 0, 1)

    # ------------------------------------------------------------------ records
    def _new_record(self, k: int) -> dict[str, Any]:
        """Create the record of the state after k rounds (W, B, Sigma as they are now)."""
        assert self.state is not None and len(self.records) == k
        record: dict[str, Any] = round_record(
            k, primal=None, dual=None, gap=None, num_dropped=None,
            objective_omega=self.state.formulation.omega_objective(self.state.dim),
            objective=None)
        if self.privacy is not None:
            record.update(self.privacy.record_fields())
        return self.book.open(record, regulariser=self.state.regulariser())

    def _consistent_tasks(self, accepted: dict[int, dict[str, Any]]) -> list[int]:
        """The tasks whose device kept its state (``state-ok``): a restarted one's numbers
        are not those of the record's (W, alpha)."""
        return [t for t, r in accepted.items() if r["state-ok"]]

    def _complete_dual(self, record: dict[str, Any], accepted: dict[int, dict[str, Any]],
                       reg: float) -> None:
        dual = np.array([accepted[t]["dual-mean"] for t in range(self.num_tasks)])
        record["dual"] = float(dual.sum()) - reg
        record["gap"] = record["primal"] - record["dual"]
