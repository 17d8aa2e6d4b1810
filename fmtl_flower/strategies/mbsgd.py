"""Mini-batch SGD (the MOCHA paper's Mb-SGD baseline) as a Flower ``Strategy``.

The objective is MOCHA's W-step (:mod:`fmtl_flower.core.baselines`)

    P(W) = sum_t L_t(w_t) + (1/2) tr(W K W^T),   L_t(w) = (1/n_t) sum_i l(y_ti x_ti^T w),

with K the regulariser matrix of the chosen formulation (:mod:`fmtl_flower.core.formulations`)
and l the loss (``loss``: the hinge max(0, 1 - z) by default, or any loss of
:mod:`fmtl_flower.core.losses` with a ``derivative``, sent to the devices as config ``loss``).
Round h: every task's node sums the loss's (sub)gradients at its w_t over a mini-batch of
``budget`` distinct samples; the server takes the projected stochastic subgradient step
(:func:`fmtl_flower.core.baselines.mbsgd_server_step`)

    W <- Proj( W - step_h * ([g_1 / c_1, ..., g_m / c_m] + W K) ),  step_h = mbsgd_step_size(h),

c_t the task's sample count (0 for a task that dropped or did not reply: no loss term), Proj
onto the Frobenius ball of radius ``mbsgd_radius(K, max D)``, which contains W*. Unlike the
reference, the regulariser's gradient W K is included and every task's loss gradient is its
own mean. It is a primal method: devices keep no state, and no dual or duality gap exists.

Wire contract
-------------
Every message to a task's node carries a ``config`` ConfigRecord and an ``arrays`` ArrayRecord.

query ``whoami`` (server -> node): empty ``config``. Reply (MOCHA's,
    :meth:`fmtl_flower.clients.mocha.MOCHAClient.whoami`): ConfigRecord ``info`` with
    ``task-id`` (int, 0 <= id < num_tasks), ``n-train`` (int >= 1), ``n-test`` (int >= 0),
    ``dim`` (int, the same on every node), ``max-row-norm`` (float, the largest training-row
    norm; bounds ``grad``, below).

``train`` (server -> node):
    arrays ``w``: float64 (d,), the task's current model w_t = W[:, t];
    config ``task-id`` int, ``server-round`` int >= 1, ``budget`` int, 0 <= budget <= n-train
    (mini-batch size: the samples ``order[:budget]``, order =
    ``coordinate_order(seed, task-id, server-round, n-train)``), ``seed`` int, ``dropped``
    bool (simulated drop-out: do no work, count 0), ``eval`` bool (also report the test
    errors of w_t), ``loss`` str (only when the run's loss is not the hinge).
    Reply: arrays ``grad`` float64 (d,), the summed (sub)gradient
    ``sum_{i in batch} l'(z_i) y_i x_i``, z_i = y_i x_i^T w_t (the hinge's:
    ``sum -y_i x_i [z_i < 1]``; all zeros when count is 0); metrics
    ``task-id`` int, ``round`` int (= server-round), ``n-train`` int, ``count`` int (samples
    used: 0 if dropped, else ``budget``), ``loss-mean`` float >= 0 (mean loss at the w_t
    received, over all n-train samples), and with ``eval`` ``test-errors``, ``test-n`` (ints,
    0 <= test-errors <= test-n).

``evaluate`` (server -> node, once, after the last round): ``w`` and config ``task-id``,
    ``server-round``, ``seed``, ``eval`` (true); reply: the same metrics without ``count``,
    no arrays.

Every reply is validated (record and key presence, int metrics typed as ints, finite values,
``grad`` float64 of shape (d,) and finite, matching task, round and n-train,
``count <= budget``, ``count == 0`` when dropped, ``grad == 0`` when ``count == 0``); a reply
that fails counts as a dropped node with a logged reason and leaves W untouched by its term.
A reply holding anything the contract does not name (another record, metric or array, or
arrays above the bytes of ``grad``'s shape) is rejected before it is decoded
(:data:`REPLY_CONTRACTS`). Bounds: each term is l'(z_i) y_i x_i with |z_i| <= R_t |w_t|, so
``|grad|_2 <= count R_t s_t``, s_t = sup |l'| there (the loss's ``derivative_bound``: 1
for the hinge, whose subgradient is ``-y_i x_i`` or 0), with R_t the task's
``max-row-norm`` from ``whoami`` (or the run's ``max_row_norm``, which overrides it; every
reply of a task with neither is rejected, the final ``evaluate`` round's too);
``loss-mean <= 1 + R_t |w_t|`` (the loss's ``value_bound``); ``test-n`` at most the
discovery limit ``max_n``. A step that leaves W non-finite is not taken (W kept, the round's
replies rejected).

Robust mode (``robust``, default on; ``robust=False``: as before) uses MOCHA's caps
(:mod:`fmtl_flower.strategies.mocha`): R~_t, the federation-capped row norm, in every bound
above, and the fenced ``n-train`` for the mini-batch sizes. A task whose mean subgradient
|grad| / count uses half its bound (R sup |l'|, on that scale) or more while the others' use
10 times less, or whose model's largest margin |w_t| R_t exceeds 5 times the others' median,
or whose w_t R_t lies farther from the federation's consensus than the others' distances
make plausible (:func:`~fmtl_flower.core.decoupling.consensus_fence`), three rounds running
(on the scale min(R~_t, median R~)), is decoupled for the rest of the run: K becomes K' =
M'^-1, block diagonal (:func:`~fmtl_flower.core.decoupling.block_diagonal_regulariser`: no
cross term pulls the others), and the projection treats each block on its own ball
(:func:`~fmtl_flower.core.decoupling.project_blocks`), so a decoupled column can no longer
shrink the others through the shared Frobenius projection; the Omega-step sees its model as
0. Every task's loss counts with weight 1 in P whatever its ``n-train`` (no device carries
more than 1/m of the sum). Records list ``tasks_decoupled``.

Round bookkeeping
-----------------
As in :class:`fmtl_flower.strategies.mocha.MOCHA`: the losses a node reports in round r are
at the model after round r - 1, so record k (state after k rounds, k = 0 .. R) is completed
by round k + 1's replies, and record R by the final ``evaluate`` round. ``primal`` is
``sum_t loss-mean_t + (1/2) tr(W K W^T)`` of that state (K as it is after any Omega-step of
round k), and only when every task reported; otherwise None (``tasks_missing`` says which
tasks were missing). ``dual`` and ``gap`` are always None, so ``gap_certified`` is always
false (the devices' losses cannot be checked without a dual) and ``certificate_rejections``
0. Flower's ``Result`` and
``fraction_train`` / ``min_train_nodes`` as for MOCHA (``evaluate_metrics_clientapp[k]`` per
evaluated state; unsampled tasks are sent ``dropped = true``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from functools import partial
from logging import INFO, WARNING
from types import MappingProxyType
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from ..core.baselines import mbsgd_radius, mbsgd_server_step, mbsgd_step_size
from ..core.decoupling import (
    OutlierWatch,
    block_diagonal_regulariser,
    coupled_models,
    federation_scale,
    project_blocks,
)
from ..core.formulations import Formulation, make_formulation
from ..core.losses import get_loss
from ..core.mocha import formulation_arrays, omega_step_due, set_formulation_arrays
from ..metrics import round_record
from ..packing import StackGroup
from ..settings import MbSGDSettings, apply_settings, check_num_tasks, drop_prob_of
from ..systems.heterogeneity import drop_mask, local_budgets
from ..systems.timing import round_time
from ..wire import array_record, config_record, from_array, record_dict, to_array
from .base import TaskStrategy, check_initial_dim, initial_model
from .discovery import (
    ReplyError,
    TaskDirectory,
    arrays_of,
    check_task_and_round,
    read_metrics,
)
from .linear_tasks import LinearTasks
from .packed_mbsgd import PROTOCOL as STACKING_PROTOCOL
from .packed_mbsgd import read_stacked_reply as read_stacked_mbsgd
from .packed_mocha import stacked_message
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

__all__ = ["SCHEDULES", "MbSGD", "ReplyError"]

RoundCallback = Callable[[dict[str, Any]], None]
SCHEDULES = ("inv", "inv_sqrt")
_NAME = "Mb-SGD"

#: What a reply may hold, by message type (the wire contract above; ``d``: the dimension):
#: anything else rejects it before it is decoded (:class:`~.trust.ReplyContract`).
REPLY_METRICS = ("task-id", "round", "n-train", "loss-mean", "test-errors", "test-n")
REPLY_CONTRACTS = {
    MessageType.TRAIN: ReplyContract.of((*REPLY_METRICS, "count"), {"grad": ("d",)}),
    MessageType.EVALUATE: ReplyContract.of(REPLY_METRICS)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class MbSGD(LinearTasks, TaskStrategy):
    """Mini-batch stochastic subgradient descent on MOCHA's primal (the Mb-SGD baseline).

    Minimises ``P(W) = sum_t mean_i l(y_ti x_ti^T w_t) + (1/2) tr(W K W^T)`` (per-task
    mean losses, summed over tasks, as MOCHA; l the hinge by default, ``loss``) for the
    regulariser matrix K of a formulation of the MOCHA paper's appendix B. Each round, every
    node sends the summed (sub)gradient of
    a mini-batch at its w_t; the server takes a projected step with the regulariser's gradient
    ``W K`` included (:func:`fmtl_flower.core.baselines.mbsgd_server_step`).

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
        The formulation whose K is used (:func:`fmtl_flower.core.formulations.make_formulation`).
    omega_every : int
        Rounds between Omega-steps ``formulation.omega_step(W)`` (0, the default: K stays
        fixed, the paper's W-update comparison; never after the last round).
    omega_eps, lam2, s2, eta, clusters : optional
        Formulation options, as for :class:`fmtl_flower.strategies.mocha.MOCHA`.
    beta : float, optional
        Step-size scale (> 0). Default ``1 / lambda_min(K)`` (Pegasos's rule with
        ``schedule="inv"``), recomputed from the current K after every Omega-step.
    schedule : {"inv", "inv_sqrt"}
        ``beta / h`` or ``beta / sqrt(h)`` in round h (:func:`mbsgd_step_size`).
    project : bool
        Project W onto the Frobenius ball of radius ``mbsgd_radius(K)`` (contains W*) after
        every step (recomputed with K).
    local_frac : float
        Mini-batch size per round as a fraction of n_t (when ``sys_het="none"``); every budget
        is capped at n_t (a mini-batch is a set of distinct samples).
    sys_het, sys_het_base : str
        Systems heterogeneity of the budgets, see :mod:`fmtl_flower.systems.heterogeneity`.
    drop_prob : float
        Probability that a node does no work in a round (simulated, seeded).
    eval_every : int
        Rounds between test-error evaluations (the final model is always evaluated).
    network : {"wifi", "lte", "3g"}
        Link of the estimated-time model (:mod:`fmtl_flower.systems.timing`, method "mb-sgd").
    time_model : {"physical", "reference"}
        Network constants: measured link figures, or the reference code's cost units.
    seed : int
        Seed of budgets, drops and the devices' sample orders.
    discovery_timeout : float
        Seconds to wait, at the first round, for ``num_tasks`` nodes to appear (at most
        ``start``'s ``timeout``; fewer than ``min_tasks`` raise ``DiscoveryError``).
    max_row_norm : float, optional
        The bound R on every task's row norms (module docstring); None: each task's
        ``max-row-norm`` from discovery.
    dim : int, optional
        The feature dimension when configured (None: by majority of the nodes).
    on_round : callable, optional
        Called with each completed round record (a dict).
    settings : MbSGDSettings, optional
        The parameters above and the common knobs (``min_tasks``, Flower's) as one checked object
        (:mod:`fmtl_flower.settings`); keyword arguments override it.

    Attributes
    ----------
    W : ndarray of shape (d, m) or None
        The current models (None before discovery).
    formulation : Formulation
        The formulation; ``formulation.regulariser_matrix()`` is K.
    records : list of dict
        One record per state k = 0 .. R (see the module docstring); read them with
        :meth:`results`.
    """

    #: Settings this strategy derives its own value of (SettingsHome).
    derived_settings = frozenset({"drop_prob"})

    def __init__(self, num_tasks: int | None = None, settings: MbSGDSettings | None = None,
                 *, dim: int | None = None, on_round: RoundCallback | None = None,
                 **kwargs: Any) -> None:
        s = MbSGDSettings.resolve(settings, kwargs)
        self.settings = s
        if num_tasks is None:  # built by start, for the tasks online
            self.build_at_start(partial(MbSGD.__init__, self, settings=s,
                                        dim=dim, on_round=on_round), s)
            return
        self.num_tasks = check_num_tasks(num_tasks)
        self.formulation_options = s.formulation_options
        self.formulation: Formulation = make_formulation(s.omega, self.num_tasks, lam=s.lam,
                                                         **self.formulation_options)
        self.directory = TaskDirectory(self.num_tasks, _NAME, dim=dim)
        apply_settings(self, s)
        self.drop_prob = drop_prob_of(s.drop_prob)
        drop_mask(self.num_tasks, self.drop_prob, seed=0, server_round=1)  # per-task: m long
        self.on_round = on_round
        self.round_timeout = 120.0
        self.num_rounds: int | None = None
        self.W: np.ndarray | None = None
        self.ever_replied = np.zeros(self.num_tasks, dtype=bool)
        self.book = RoundRecords()  # one record per state (strategies/records.py)
        self.replies = ReplyBoundary(_NAME, REPLY_CONTRACTS, lambda: {"d": self.dim})
        self.sent_rounds = SentRounds(_NAME)  # each exchange's SentRound, until read
        self._round_start = 0.0
        self.watch = OutlierWatch(self.num_tasks)  # robust mode's decoupling, sticky
        self._refresh_matrices()

    @property
    def decoupled(self) -> np.ndarray:
        """The tasks robust mode decoupled (bool, (m,)), :mod:`fmtl_flower.core.decoupling`."""
        return self.watch.decoupled

    # ------------------------------------------------------------------ K and its constants
    def _refresh_matrices(self) -> None:
        """Cache K, the step scale and the projection radius for the current formulation."""
        K = self.formulation.regulariser_matrix()
        self.K = 0.5 * (K + K.T)
        if self.decoupled.any():  # robust mode: K' = M'^-1, block diagonal
            self.K = block_diagonal_regulariser(self.K, self.decoupled)
        lam_min = float(np.linalg.eigvalsh(self.K)[0])
        if not lam_min > 0:
            raise ValueError(f"K must be positive definite, smallest eigenvalue {lam_min}")
        self.step_scale = self.beta if self.beta is not None else 1.0 / lam_min
        dual_max = get_loss(self.loss).dual_range[1]  # 1 for the hinge
        self.radius = (mbsgd_radius(self.K, dual_max)
                       if self.project and math.isfinite(dual_max) else None)

    def regulariser(self, W: np.ndarray) -> float:
        """(1/2) tr(W K W^T) for the current K."""
        return 0.5 * float(np.einsum("ij,ij->", W @ self.K, W))

    # ------------------------------------------------------------------ Strategy interface
    samples_devices = True
    _seed_W: np.ndarray | None = None  # start()'s initial W0, until discovery

    def summary(self) -> None:
        """Log the configuration."""
        log(INFO, "\t├── %s: %d tasks, lambda=%g, omega=%s every %d rounds", _NAME,
            self.num_tasks, self.lam, self.omega, self.omega_every)
        log(INFO, "\t├── step %s / %s, projection %s", "1/lambda_min(K)" if self.beta is None
            else f"{self.beta:g}", "h" if self.schedule == "inv" else "sqrt(h)",
            "on" if self.project else "off")
        log(INFO, "\t└── local-frac=%g, sys-het=%s (%s), drop-prob=%g, seed=%d",
            self.local_frac, self.sys_het, self.sys_het_base, self.drop_prob, self.seed)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One ``train`` message per reachable task, with its w_t and mini-batch size."""
        self._round_start = time.perf_counter()
        self.discover(grid, wait=server_round == self.first_round)
        if self.W is None:
            raise RuntimeError(
                f"{_NAME} found no usable node: check that the ClientApp is Mb-SGD's and that "
                "nodes report a task id (--node-config \"task-id=N\")")
        if len(self.records) < server_round:  # state before this round, completed by replies
            self._new_record(server_round - 1)
        known = np.flatnonzero(self.n_train > 0)
        budgets = np.zeros(self.num_tasks, dtype=np.int64)
        budgets[known] = np.minimum(
            local_budgets(self._budget_sizes(known), local_frac=self.local_frac,
                          sys_het=self.sys_het,
                          base=self.sys_het_base, seed=self.seed, server_round=server_round),
            self.n_train[known])
        dropped = drop_mask(self.num_tasks, self.drop_prob, seed=self.seed,
                            server_round=server_round)
        sampled = self.sample_train_tasks(self.task_to_node, server_round, self.seed)
        if len(sampled) < len(self.task_to_node):  # fraction_train: the others sit it out
            resting = np.ones(self.num_tasks, dtype=bool)
            resting[sampled] = False
            dropped = dropped | resting
        evaluate = (server_round - 1) % self.eval_every == 0
        return self._instructions(server_round, MessageType.TRAIN, evaluate, grid=grid,
                                  budgets=budgets, dropped=dropped, num_sampled=len(sampled))

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord]:
        """Validate replies, complete the previous state's record, take the W-step."""
        assert self.W is not None and self.dim is not None
        sent = self.sent_rounds.take(MessageType.TRAIN, server_round)
        if sent is None:
            drop_unsent(self.replies, MessageType.TRAIN, server_round, replies)
            return None, MetricRecord({"num-replies": 0, "num-dropped": self.num_tasks,
                                       "num-sampled": 0})
        accepted, arrived = self._read_replies(sent, replies)
        completed = self._complete_record(server_round - 1, accepted)
        if sent.evaluate and accepted:  # state r - 1's test errors
            self.report_evaluation(server_round - 1, completed, accepted)
        G = np.zeros((self.dim, self.num_tasks))
        counts = np.zeros(self.num_tasks, dtype=np.int64)
        for task, reply in accepted.items():
            G[:, task] = reply["grad"]
            counts[task] = reply["count"]
        if self.robust and accepted:
            self._decouple_outliers(server_round, G, counts)
        step = mbsgd_step_size(server_round, beta=self.step_scale, schedule=self.schedule)
        blocks = self.decoupled.any()
        W = mbsgd_server_step(self.W, G, self.K, counts=counts, step=step,
                              radius=None if blocks else self.radius)
        if blocks and self.project:  # each block onto its own ball
            W = project_blocks(W, self.K, self.decoupled)
        if all_finite(W):
            self.W = W
        else:  # the bounds make this unreachable: belt and braces
            log(WARNING, "%s round %d: the step left W non-finite; not taken, the replies of "
                "tasks %s rejected", _NAME, server_round, sorted(accepted)[:20])
            accepted, counts = {}, np.zeros_like(counts)
        omega_step = omega_step_due(server_round, self.omega_every, self.num_rounds)
        if omega_step:
            def omega_update() -> None:
                self.formulation.omega_step(coupled_models(self.W, self.decoupled))
                self._refresh_matrices()

            reason = guarded(omega_update, (self.formulation, self), lambda: all_finite(self.K))
            if reason is not None:
                log(WARNING, "%s round %d: the Omega-step failed (%s); undone, Omega kept",
                    _NAME, server_round, reason)
                omega_step = False
        record = self._new_record(server_round)
        used = int(np.count_nonzero(counts))
        if self.robust:
            record["tasks_decoupled"] = [int(t) for t in np.flatnonzero(self.decoupled)]
        record.update(num_replies=len(accepted), num_dropped=self.num_tasks - used,
                      samples=int(counts.sum()), step_size=step, omega_step=omega_step,
                      estimated_time_s=self._estimated_time(accepted, arrived, sent),
                      wall_time_s=time.perf_counter() - self._round_start)
        metrics = MetricRecord({"num-replies": len(accepted), "num-dropped": record["num_dropped"],
                                "num-sampled": sent.num_sampled})
        return ArrayRecord({"W": to_array(self.W)}), metrics

    def _decouple_outliers(self, server_round: int, G: np.ndarray, counts: np.ndarray) -> None:
        """Robust mode: decouple (sticky) the tasks whose round's mean subgradient, or whose
        model's largest margin |w_t| R_t, is an outlier against the federation's
        (:class:`~fmtl_flower.core.decoupling.OutlierWatch`); K becomes block diagonal
        (:meth:`_refresh_matrices`), each newly decoupled task logged once."""
        assert self.W is not None
        scale = federation_scale(self._row_norms(np.arange(self.num_tasks)))
        w_norm = norm(self.W, axis=0)  # the models the gradients were taken at
        slope = get_loss(self.loss).derivative_bound(scale * w_norm)  # 1 for the hinge
        new = self.watch.update(norm(G, axis=0), counts * scale * slope, w_norm,
                                1.0 / scale, counts > 0, images=self.W)
        if not new.any():
            return
        self._refresh_matrices()
        log(WARNING, "%s round %d: task%s %s decoupled from the others (off-diagonal "
            "coupling in K^-1 set to 0 for the rest of the run): their updates are outliers "
            "against the federation's (robust mode)", _NAME, server_round,
            "s" if new.sum() > 1 else "", np.flatnonzero(new).tolist()[:20])

    def _estimated_time(self, accepted: dict[int, dict[str, Any]], arrived: int,
                        sent: SentRound) -> float:
        """Eq. (30) with method "mb-sgd": the slowest replying node sets the round's time.

        A reply that arrived but was rejected (or an error reply) still cost its node the
        communication; a node that never replied kept the server waiting for the round
        timeout.
        """
        assert self.dim is not None
        counts = [accepted[t]["count"] for t in sorted(accepted)]
        counts += [0] * (arrived - len(accepted))
        t_round = round_time(np.array(counts, dtype=np.int64), self.dim, "mb-sgd", self.network,
                             model=self.time_model, loss=self.loss)
        if arrived < len(sent.exchange.sent):
            t_round = self.round_timeout
        return float(t_round)

    def _final_instructions(self, server_round: int, grid: Grid) -> Iterable[Message]:
        return self._instructions(server_round, MessageType.EVALUATE, True, grid=grid)

    def _final_replies(self, server_round: int,
                       replies: Iterable[Message]) -> dict[int, dict[str, Any]]:
        sent = self.sent_rounds.take(MessageType.EVALUATE, server_round)
        if sent is None:
            drop_unsent(self.replies, MessageType.EVALUATE, server_round, replies)
            return {}
        return self._read_replies(sent, replies)[0]

    # ------------------------------------------------------------------ discovery
    def discover(self, grid: Grid, wait: bool = False) -> None:
        """Map new node ids to tasks (``whoami``); create W = 0 once ``dim`` is known."""
        self.directory.discover(grid, wait=self.discovery_timeout if wait else 0.0,
                                query_timeout=max(self.round_timeout, 60.0))
        if self.W is None and self.directory.dim is not None:
            self.W = np.zeros((self.directory.dim, self.num_tasks))
            if self._seed_W is not None:  # start()'s initial_arrays: the primal start
                check_initial_dim(self._seed_W, self.directory.dim, "W", _NAME)
                self.W[:] = self._seed_W if self._seed_W.ndim == 2 else self._seed_W[:, None]
                self._seed_W = None

    def seed_model(self, initial_arrays: ArrayRecord) -> None:
        """Start from ``initial_arrays`` = ``ArrayRecord([W0])`` (or key ``"W"``), W0 of shape
        (d, m) or (d,) (one model for every task): Mb-SGD is primal, so W = W0 before round 1
        (checked here for shape and finiteness, d against the nodes' ``dim`` at discovery)."""
        if len(initial_arrays):
            self._seed_W = initial_model(initial_arrays, "W", self.num_tasks, _NAME,
                                         self.directory.dim)

    @property
    def dim(self) -> int | None:
        return self.directory.dim

    # ------------------------------------------------------------------ checkpoints
    def fingerprint(self) -> dict[str, Any]:
        """Settings a checkpoint must share with this run to be resumed."""
        return {"strategy": "MbSGD", "num_tasks": self.num_tasks, "lam": self.lam,
                "omega": self.omega, "formulation": self.formulation_options,
                "beta": self.beta, "schedule": self.schedule, "project": self.project,
                "seed": self.seed, **({"loss": self.loss} if self.loss != "hinge" else {})}

    def checkpoint_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """W, the formulation's Omega, the records and (robust mode) the decoupling watch's
        state (the devices keep no state)."""
        assert self.W is not None
        arrays = {"W": self.W, **{f"formulation.{k}": v
                                   for k, v in formulation_arrays(self.formulation).items()}}
        if self.robust:
            arrays.update(self.watch.state_arrays())
        return arrays, {"records": self.book.to_meta()}

    def restore_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Load :meth:`checkpoint_state`'s output."""
        W = np.asarray(arrays["W"], dtype=np.float64)
        if W.ndim != 2 or W.shape[1] != self.num_tasks or not np.all(np.isfinite(W)):
            raise ValueError(f"checkpoint W must be finite (d, {self.num_tasks})")
        set_formulation_arrays(self.formulation, {
            k[len("formulation."):]: v for k, v in arrays.items()
            if k.startswith("formulation.")})
        self.watch.restore(arrays)
        self._refresh_matrices()
        self.W = W.copy()
        self.directory.dim = W.shape[0]
        self.book.load(meta["records"])

    # ------------------------------------------------------------------ messages
    def _instructions(self, server_round: int, message_type: str, evaluate: bool,
                      grid: Grid | None = None, *, budgets: np.ndarray | None = None,
                      dropped: np.ndarray | None = None, num_sampled: int = 0
                      ) -> list[Message]:
        """The exchange's messages, made from its
        :class:`~fmtl_flower.strategies.round_state.SentRound` (kept in :attr:`sent_rounds`
        until the replies are read against it): one stacked message per packed node that
        speaks Mb-SGD's stacking protocol (:mod:`~fmtl_flower.strategies.packed_mbsgd`), one
        per task otherwise. ``budgets`` None: no work (the evaluate exchange)."""
        assert self.W is not None
        targets = dict(self.task_to_node)
        groups: list[StackGroup] = []
        stacked_groups = getattr(grid, "stacked_groups", None)
        if callable(stacked_groups):
            groups, targets = stacked_groups(STACKING_PROTOCOL, targets)
        sent = self.sent_rounds.add(SentRound(
            server_round, message_type, bool(evaluate),
            MappingProxyType({"seed": self.seed, "eval": bool(evaluate),
                              **({"loss": self.loss} if self.loss != "hinge" else {})}),
            models=frozen_array(self.W.T), w_norm=frozen_array(norm(self.W, axis=0)),
            budgets=None if budgets is None else frozen_array(budgets, np.int64),
            dropped=frozen_array(np.zeros(self.num_tasks, dtype=bool) if dropped is None
                                 else dropped, np.bool_),
            chosen=MappingProxyType(targets), stacks=tuple(groups), num_sampled=num_sampled,
            exchange=self.replies.begin()))
        messages = []
        shared = {"server-round": server_round, **sent.config}
        per_task = sent.stacked_vectors()
        for group in sent.stacks:
            messages.append(sent.exchange.track_stack(group, stacked_message(
                group, message_type, server_round, shared, sent.models.T, per_task,
                STACKING_PROTOCOL)))
        for task, node in sorted(sent.chosen.items()):
            config: dict[str, Any] = {"task-id": task, "server-round": server_round,
                                      **sent.config}
            if sent.budgets is not None:
                config["budget"] = int(sent.budgets[task])
                config["dropped"] = bool(sent.dropped[task])
            content = record_dict({"arrays": array_record({"w": sent.models[task]}),
                                   "config": config_record(config)})
            messages.append(sent.exchange.track(task, node, Message(
                content, dst_node_id=node, message_type=message_type,
                group_id=str(server_round))))
        return messages

    def _read_replies(self, sent: SentRound, replies: Iterable[Message]
                      ) -> tuple[dict[int, dict[str, Any]], int]:
        """Validated replies to the exchange ``sent``, keyed by task, in task order, checked
        against what it sent (invalid ones logged and left out:
        :class:`~fmtl_flower.strategies.trust.ReplyBoundary`; a stacked reply per row), and
        the number of replies that arrived from nodes the round was sent to."""
        def on_accept(task: int) -> None:
            self.ever_replied[task] = True

        server_round = sent.server_round
        out = self.replies.read(
            f"round {server_round}", replies,
            lambda reply, task: self._parse_reply(reply, task, sent),
            on_accept,
            lambda reply, group: self._parse_stack(reply, group, sent),
            lambda rows: self._check_rows(rows, sent), exchange=sent.exchange)
        return out.accepted, out.arrived

    def _parse_stack(self, reply: Message, group: StackGroup, sent: SentRound
                     ) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
        """The rows of a stacked reply as :meth:`_parse_reply` gives one reply's values, and
        the rejected tasks with their reasons (checked in vectorised form; the bounds that
        need R_t are :meth:`_check_rows`', which ``ReplyBoundary.read`` applies to them)."""
        assert self.dim is not None and self.W is not None
        budgets = sent.budgets if sent.with_work else np.zeros(self.num_tasks, np.int64)
        return read_stacked_mbsgd(reply, group, sent.server_round, self.n_train, self.dim,
                                  sent.with_work, budgets, sent.dropped, self.directory.max_n)

    def _parse_reply(self, reply: Message, task: int, sent: SentRound) -> dict[str, Any]:
        """One reply's keys, types, shapes and values against the exchange ``sent`` (its
        round, the task's budget and drop-out); the bounds that need R_t are
        :meth:`_check_rows`'."""
        assert self.dim is not None
        server_round, with_grad = sent.server_round, sent.with_work
        ints = ("task-id", "round", "n-train") + (("count",) if with_grad else ())
        out = read_metrics(reply, ints=ints, numbers=("loss-mean",),
                           optional_ints=("test-errors", "test-n"))
        check_task_and_round(out, task, server_round)
        if out["n-train"] != self.n_train[task]:
            raise ReplyError(f"n-train {out['n-train']} differs from {self.n_train[task]}")
        if out["loss-mean"] < 0:
            raise ReplyError(f"loss-mean must be >= 0, got {out['loss-mean']}")
        self._check_tests(out)
        if with_grad:
            limit = 0 if sent.dropped[task] else int(sent.budgets[task])
            if not 0 <= out["count"] <= limit:
                raise ReplyError(f"count {out['count']} outside 0..{limit} (budget "
                                 f"{int(sent.budgets[task])}"
                                 f"{', dropped' if sent.dropped[task] else ''})")
            arrays = arrays_of(reply)
            if arrays is None or "grad" not in arrays:
                raise ReplyError("array 'grad' missing")
            grad = from_array(arrays["grad"])
            if grad.dtype != np.float64 or grad.shape != (self.dim,):
                raise ReplyError(f"'grad' must be float64 of shape ({self.dim},), "
                                 f"got {grad.dtype} {grad.shape}")
            if not np.all(np.isfinite(grad)):
                raise ReplyError("'grad' has non-finite values")
            if out["count"] == 0 and np.any(grad != 0.0):
                raise ReplyError("'grad' must be zero when count is 0")
            out["grad"] = grad
        return out

    def _check_rows(self, rows: dict[int, dict[str, Any]], sent: SentRound) -> dict[int, str]:
        """The bounds that need R_t over parsed replies ``rows`` (the one-task replies of a
        round, or the valid rows of a stacked reply) to the exchange ``sent`` (|w_t| as
        sent), vectorised: the rejected tasks with their reasons. Checked in this order, a
        reply keeping the first reason: no R_t, ``loss-mean``
        (:meth:`~.linear_tasks.LinearTasks._bound_rows`), ``|grad|``."""
        tasks = np.fromiter(rows, dtype=np.int64, count=len(rows))
        rejected: dict[int, str] = {}
        bound = self._bound_rows(rows, tasks, rejected, sent.w_norm)
        if sent.with_work:
            size = np.array([norm(rows[t]["grad"]) for t in tasks.tolist()])
            count = np.array([rows[t]["count"] for t in tasks.tolist()], dtype=np.int64)
            slope = get_loss(self.loss).derivative_bound(bound * sent.w_norm[tasks])
            limit = count * bound * slope  # |l'(z)| <= slope at |z| <= R_t |w_t|
            for i in np.flatnonzero(~(size <= limit * BOUND_SLACK)).tolist():
                rejected.setdefault(int(tasks[i]), (
                    f"|grad| = {size[i]:.6g} above its bound {limit[i]:.6g} (count {count[i]} "
                    f"x max-row-norm {bound[i]:g} x sup |l'| {slope[i]:g})"))
        return rejected

    # ------------------------------------------------------------------ records
    def _new_record(self, k: int) -> dict[str, Any]:
        """Create the record of the state after k rounds (W and K as they are now)."""
        assert self.W is not None and len(self.records) == k
        record: dict[str, Any] = round_record(
            k, primal=None, dual=None, gap=None, num_dropped=None, samples=None,
            step_size=None, omega_step=None, estimated_time_s=None,
            objective_omega=self.formulation.omega_objective(self.W.shape[0]),
            objective=None)
        return self.book.open(record, regulariser=self.regulariser(self.W))
