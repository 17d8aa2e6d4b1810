"""OFMTL (Li et al. 2019): devices that join a running MOCHA federation, served with O(1)
communication, and a full MOCHA retraining when enough have joined.

The federation starts as MOCHA (probabilistic formulation) over the first ``initial_tasks``
tasks. A newcomer (task m, the next task id) is then served alone: the server extends
Sigma to blockdiag(m/(m+1) Sigma, 1/(m+1)) (trace 1), and for ``outer`` steps sends the
newcomer omega = Omega[m, m] and c = sum_t Omega[t, m] w_t (d + 1 floats); the newcomer
continues SDCA on its single-task subproblem for ``inner`` rounds and returns w (d floats);
the server puts w in W's new column and, between steps, takes the Omega-step over all m + 1
columns (:mod:`fmtl_flower.core.ofmtl`). The other devices are never contacted and their
columns stay frozen. When the newcomers since the last (re)training reach ``retrain_ratio``
times the tasks of that training, MOCHA is retrained from scratch over every present task.

Arrivals: task ids are admitted in order ``initial_tasks, initial_tasks + 1, ...``. In
deployment a newcomer is a SuperNode started with ``--node-config "task-id=m"`` while the run
is going: the server polls the grid for it (``arrival_timeout`` seconds). In simulation every
node exists from the start and the tasks beyond the present ones are held back (their nodes
are not contacted); the run-config key ``arrivals`` permutes which dataset task each task id
serves (:func:`fmtl_flower.apps.common.dataset_task_of`), i.e. the order of arrival.

A newcomer that fails or drops out mid-protocol leaves W and Sigma exactly as they were (the
protocol works on a copy, committed only when every step succeeded); the task is asked again
right away, up to ``max_attempts`` times.

Server path: Sigma is an m x m array (``dense``), or V diag(s) V^T + c I with V m x r
(``factored``, :mod:`fmtl_flower.core.ofmtl_factored`; r <= d after an Omega-step, plus one
per extension since: O(m d) memory and O(m d^2) per newcomer round trip instead of O(m^2) and
O(m^3)). ``server_path="auto"`` takes
:func:`fmtl_flower.core.mocha_factored.choose_server_path` for the run's ``num_tasks`` (the
largest m it reaches) and the models' d, once per run; every MOCHA (re)training runs on the
same path, and OFMTL takes its factored Sigma as is. Both paths give the same W and Sigma to
rounding.

Wire contract (besides MOCHA's, :mod:`fmtl_flower.strategies.mocha`)
--------------------------------------------------------------------
``train.ofmtl`` (server -> newcomer): arrays ``c`` float64 (d,); config ``task-id``,
``step`` (0 .. outer - 1), ``inner-rounds``, ``seed`` (ints), ``omega``, ``lambda``,
``local-frac`` (floats), and the run's ``loss`` (str) when it is not the hinge. Reply:
arrays ``w`` float64 (d,), finite; metrics ``task-id``, ``step``, ``n-train``,
``state-ok`` (ints; state-ok 0: the device restarted from alpha = 0),
``gap`` (float >= 0, the subproblem's duality gap). Bound: ``w = (b - lambda c) / (lambda
omega)`` with ``b = X^T alpha / n`` and ``|b| <= R`` (the newcomer's ``max-row-norm`` from
``whoami``; a newcomer without one is rejected) for a feasible alpha, so
``|lambda omega w + lambda c|_2 <= R``, and ``gap <= 1 + R |w| + lambda omega |w|^2 +
lambda |c| |w|`` (the loss's bound plus w^T b: the gap is mean l - mean D + w^T b). For
another loss (``mocha.loss``, which the
MOCHA trainings and the newcomer's subproblem both take): ``R`` times the loss's dual radius
(no bound on w for the squared loss, whose dual is unbounded), and ``1 + R |w|`` is the loss's
``value_bound(R |w|)`` less the least value of its dual term (0, or -inf: no gap bound).
The records' ``newcomer_gap`` is that reported ``gap``: bounded, but not certified (the
server holds neither the subproblem's loss nor its dual value to check it against,
:mod:`fmtl_flower.core.certificate`). The newcomer's protocol works on a copy of W and
Sigma; a step that raises or leaves them non-finite fails the attempt (W, Sigma unchanged).

``evaluate.ofmtl`` (server -> every present device, after each event, for the metrics only):
arrays ``w`` float64 (d,): the device's column of W; config ``task-id``, ``server-round``.
Reply: metrics ``task-id``, ``round`` (the ``server-round`` sent), ``test-errors``, ``test-n``
(ints).

Sent state: each newcomer step and each evaluation is made from one frozen
:class:`~fmtl_flower.strategies.round_state.OFMTLSentExchange` (step, omega, c, d, task ->
node, the trust boundary's exchange), and its replies are checked against it alone; a reply
to a message of another exchange (late, or a second copy) is logged and dropped.

Record-level DP (``dp.mechanism=record``, :mod:`fmtl_flower.strategies.ofmtl_privacy`): every
newcomer's ``train.ofmtl`` (and MOCHA's train messages) also carries ``dp-clip`` and
``dp-noise-multiplier``; the newcomer's reply ``w`` is then its model plus Gaussian noise and
its ``gap`` is 0 (withheld); the reply bound uses ``dp-clip`` for R, widened by
lam omega times the noise's high-probability norm.

A reply holding anything these contracts do not name (another record, metric or array, or
arrays above the bytes of ``w``'s shape) is rejected before it is decoded
(:data:`REPLY_CONTRACTS`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from functools import partial
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..checkpoint import CheckpointError, check_fingerprint, read_checkpoint, write_checkpoint
from ..core.factored import FactoredMatrix, _factor_arrays, _factor_from_arrays
from ..core.losses import get_loss
from ..core.mocha_factored import choose_server_path
from ..core.ofmtl_factored import server_ops
from ..metrics import error_summary, round_record
from ..settings import OFMTLSettings, SettingsHome, apply_settings, check_num_tasks
from ..wire import from_array, to_array
from .base import SizedAtStart, check_evaluate_knobs, check_run_length
from .discovery import (
    ReplyError,
    TaskDirectory,
    arrays_of,
    check_task_and_round,
    read_metrics,
    wait_for_nodes,
)
from .mocha import MOCHA
from .record_dp import enable_record_dp
from .records import KeepsRecords, RoundRecords
from .repeated_errors import collapse_repeated_errors
from .round_state import OFMTLSentExchange
from .trust import ReplyBoundary, ReplyContract, all_finite, check_bound, norm

__all__ = ["OFMTL"]

RecordCallback = Callable[[dict[str, Any]], None]
_NAME = "OFMTL"
NEWCOMER = f"{MessageType.TRAIN}.ofmtl"
EVALUATE = f"{MessageType.EVALUATE}.ofmtl"
#: What a reply may hold, by message type (the wire contract above; ``d``: the dimension).
REPLY_CONTRACTS = {
    NEWCOMER: ReplyContract.of(("task-id", "step", "n-train", "state-ok", "gap"),
                               {"w": ("d",)}),
    EVALUATE: ReplyContract.of(("task-id", "round", "test-errors", "test-n"))}


class NewcomerFailed(RuntimeError):
    """The newcomer did not complete the protocol (no reply, error, or a bad reply)."""


class OFMTL(SettingsHome, SizedAtStart, KeepsRecords, Strategy):
    """MOCHA over the initial tasks, then O(1)-communication newcomers (module docstring).

    Of Flower's knobs, ``min_available_nodes`` (wait for that many nodes before discovery)
    is honoured; ``initial_arrays``, ``fraction_train``, ``min_train_nodes`` and the metrics
    aggregation functions are refused with a ValueError (``OFMTL._check_knobs``).

    Parameters
    ----------
    num_tasks : int or None
        Tasks of the whole run (the initial ones plus the newcomers to admit).
        None (the default): the distinct task ids of the nodes online once
        ``min_available_nodes`` are, counted when ``start`` runs (Flower's habit of sizing
        a run by its SuperNodes; :class:`~fmtl_flower.strategies.base.SizedAtStart`).
        Only the tasks online then: give the number when newcomers join later.
    initial_tasks : int
        Tasks 0 .. initial_tasks - 1 train MOCHA first.
    lam : float
        Regularisation strength lambda (MOCHA's and the newcomers').
    mocha_rounds, omega_every, local_frac, omega_eps : MOCHA's settings for every (re)training.
    outer, inner, newcomer_frac : int, int, float
        Newcomer protocol: ``outer`` round trips; ``inner`` SDCA rounds of
        ``newcomer_frac * n`` steps on the device per round trip (reference: 10, 100, 0.5).
    retrain_ratio : float
        Retrain MOCHA from scratch when newcomers since the last training reach this multiple
        of the tasks of that training (reference: 1.5; ``inf`` never).
    arrival_timeout : float
        Seconds to wait for the next newcomer's node to appear before ending the run.
    max_attempts : int
        Protocol attempts per newcomer before the run gives up on it.
    seed : int
    discovery_timeout, round_timeout : float
    server_path : {"auto", "dense", "factored"}
        How the server keeps Sigma (and MOCHA its M): an m x m array, or factored (module
        docstring); ``auto`` factors when num_tasks > 1000 and num_tasks > 2 d, or
        num_tasks > 20 000. When that depends on d, the first node's ``whoami`` tells it
        (within ``discovery_timeout``) before the initial training.
    on_record : callable, optional
        Called with each record (one per event: initial training, newcomer, retraining).
    settings : OFMTLSettings, optional
        The parameters above as one checked object
        (:mod:`fmtl_flower.settings`); keyword arguments override it.
    """

    def __init__(self, num_tasks: int | None = None, settings: OFMTLSettings | None = None,
                 *, on_record: RecordCallback | None = None, **kwargs: Any) -> None:
        s = OFMTLSettings.resolve(settings, kwargs)
        self.settings = s
        if num_tasks is None:  # built by start, for the tasks online
            self.build_at_start(partial(OFMTL.__init__, self, settings=s,
                                        on_record=on_record), s)
            return
        self.num_tasks = check_num_tasks(num_tasks, 2)
        if s.initial_tasks >= self.num_tasks:
            raise ValueError(f"initial_tasks ({s.initial_tasks}) must be below num_tasks "
                             f"({self.num_tasks}): no newcomer would join")
        # unknown path, or dense beyond its size limit: fail now; None: the choice depends
        # on d, taken at the first whoami
        self.path = choose_server_path(self.num_tasks, None, "probabilistic", s.server_path)
        apply_settings(self, s)
        self.mocha_options = {"lam": s.lam, "omega": "probabilistic",
                              "omega_every": s.omega_every, "omega_eps": s.omega_eps,
                              "local_frac": s.local_frac, "seed": s.seed,
                              "discovery_timeout": s.discovery_timeout,
                              **({} if s.loss == "hinge" else {"loss": s.loss})}
        self.loss_fn = get_loss(s.loss)
        self.on_record = on_record
        self.directory = TaskDirectory(self.num_tasks, _NAME)
        self.directory.task_owners = dict(s.task_owners)
        self.replies = ReplyBoundary(_NAME, REPLY_CONTRACTS, lambda: {"d": self.W.shape[0]})
        self.W: np.ndarray | None = None
        self.Sigma: np.ndarray | FactoredMatrix | None = None
        self.book = RoundRecords()  # one record per event, complete when made (records.py)
        self.retrainings = 0
        self.tasks_at_training = 0
        self.newcomer_floats: list[int] = []
        self.floats_total = 0
        self._started = 0.0
        self._ever_replied: set[int] = set()  # tasks that answered an evaluation
        self.checkpoint_dir: Path | None = None
        self._resume = True
        self.resumed_from: int | None = None  # records of the checkpoint resumed from

    @classmethod
    def for_run(cls, num_tasks: int, settings: OFMTLSettings,
                on_round: RecordCallback | None = None) -> OFMTL:
        """The strategy of a run (as every family's: ``TaskStrategy.for_run``); ``on_round``
        gets every event's record."""
        return cls(num_tasks, settings, on_record=on_round)

    # ------------------------------------------------------------------ checkpoints
    def enable_checkpoints(self, directory: str | Path, every: int = 1,
                           resume: bool = True) -> None:
        """Write the state (W, Sigma, records and counters) after every event: the initial
        training, each newcomer, each retraining (``every`` is accepted for the common
        interface and must be 1); with ``resume``, continue after the newest checkpoint:
        a newcomer whose protocol was cut short is served again from its first step, a cut
        retraining is run again."""
        if every != 1:
            raise ValueError("OFMTL checkpoints after every event; every must be 1")
        self.checkpoint_dir = Path(directory)
        self._resume = bool(resume)

    def fingerprint(self) -> dict[str, Any]:
        """Settings a checkpoint must share with this run to be resumed."""
        out = {"strategy": "OFMTL", "num_tasks": self.num_tasks,
               "initial_tasks": self.initial_tasks, "mocha": self.mocha_options,
               "mocha_rounds": self.mocha_rounds, "outer": self.outer, "inner": self.inner,
               "newcomer_frac": self.newcomer_frac, "retrain_ratio": self.retrain_ratio}
        if self.privacy is not None:
            out["dp"] = self.privacy.fingerprint()
        return out

    def _write_checkpoint(self) -> None:
        assert self.W is not None and self.Sigma is not None
        meta = {"fingerprint": self.fingerprint(), "records": self.book.to_meta(),
                "ever_replied": sorted(self._ever_replied),
                "retrainings": self.retrainings, "tasks_at_training": self.tasks_at_training,
                "newcomer_floats": self.newcomer_floats, "floats_total": self.floats_total}
        if isinstance(self.Sigma, FactoredMatrix):  # its factor: V (m, r), s (r,), c ()
            arrays = {"W": self.W, **_factor_arrays("Sigma", self.Sigma)}
        else:
            arrays = {"W": self.W, "Sigma": self.Sigma}
        if self.privacy is not None:  # the account
            arrays.update(self.privacy.state_arrays())
        write_checkpoint(self.checkpoint_dir, len(self.records), arrays, meta)

    def _save_account(self) -> None:
        """Rewrite the newest checkpoint with the record-level DP account as it is now (the
        committed W and Sigma are unchanged mid-event): releases made after the last event
        survive a restart. Before the first event there is no checkpoint to rewrite."""
        if self.checkpoint_dir is not None and self.W is not None and self.records:
            self._write_checkpoint()

    def _restore(self) -> bool:
        checkpoint = read_checkpoint(self.checkpoint_dir)
        if checkpoint is None:
            return False
        check_fingerprint(checkpoint, self.fingerprint())
        factored = any(k.startswith("Sigma.") for k in checkpoint.arrays)
        W = checkpoint.arrays.get("W")
        if W is None or W.ndim != 2 or not (factored or "Sigma" in checkpoint.arrays):
            raise CheckpointError(f"{checkpoint.path}: no W (d, m) and Sigma for this run")
        if self.path is None:
            self._choose_path(W.shape[0])
        if factored != (self.path == "factored"):
            raise CheckpointError(
                f"{checkpoint.path} holds a {'factored' if factored else 'dense'} Sigma; this "
                f"run's server path is {self.path} (server_path={self.server_path!r})")
        m = W.shape[1]
        if m < 1 or m > self.num_tasks or not np.all(np.isfinite(W)):
            raise CheckpointError(f"{checkpoint.path}: W {W.shape} does not fit this run")
        if factored:
            Sigma = self._restore_factored(checkpoint.path, W, checkpoint.arrays)
        else:
            Sigma = checkpoint.arrays["Sigma"]
            if Sigma.shape != (m, m) or not np.all(np.isfinite(Sigma)):
                raise CheckpointError(f"{checkpoint.path}: W {W.shape} and Sigma {Sigma.shape} "
                                      "do not fit this run")
            Sigma = Sigma.astype(np.float64)
        if self.privacy is not None:  # the account resumes
            try:
                self.privacy.restore(checkpoint.arrays, self.num_tasks)
            except ValueError as err:
                raise CheckpointError(f"{checkpoint.path}: {err}") from None
        self.W, self.Sigma = W.astype(np.float64), Sigma
        self.directory.fix_dim(self.W.shape[0])
        meta = checkpoint.meta
        self.book.load(meta["records"])
        self.retrainings, self.tasks_at_training = meta["retrainings"], meta["tasks_at_training"]
        self.newcomer_floats = [int(f) for f in meta["newcomer_floats"]]
        self.floats_total = int(meta["floats_total"])
        self._ever_replied = {int(t) for t in meta["ever_replied"]}
        self.resumed_from = checkpoint.server_round
        log(INFO, "%s: resumed from %s (%d tasks, %d events)", _NAME, checkpoint.path, self.m,
            len(self.records))
        return True

    @staticmethod
    def _restore_factored(path: Path, W: np.ndarray, arrays: dict[str, np.ndarray]
                          ) -> FactoredMatrix:
        """The factored Sigma of a checkpoint whose W (d, m) was checked; CheckpointError
        unless it fits."""
        try:
            Sigma = _factor_from_arrays(
                "Sigma", {k: v for k, v in arrays.items() if k.startswith("Sigma.")},
                W.shape[1])
            Sigma.check(atol=1e-8)
        except ValueError as err:
            raise CheckpointError(f"{path}: W {W.shape} and its factored Sigma do not fit "
                                  f"this run: {err}") from None
        return Sigma

    def _choose_path(self, dim: int) -> None:
        self.path = choose_server_path(self.num_tasks, dim, "probabilistic", self.server_path)
        log(INFO, "%s: server path %s (%d tasks, d = %d)", _NAME, self.path, self.num_tasks,
            dim)

    def _learn_path(self, grid: Grid) -> None:
        """Choose the path once d is known: from the first node's whoami (``auto`` with
        1000 < num_tasks <= 20 000 only; otherwise it was chosen at construction)."""
        if self.path is not None:
            return
        dim = self._poll(grid, lambda: self.directory.dim,
                         self.mocha_options["discovery_timeout"])
        if dim is None:  # no majority of the whole federation: one of the nodes present
            self.directory.settle()
            dim = self.directory.dim
        if dim is None:
            raise RuntimeError(f"{_NAME}: no node answered within "
                               f"{self.mocha_options['discovery_timeout']:.0f} s; the "
                               "server path (dense or factored) depends on d")
        self._choose_path(dim)

    def _poll(self, grid: Grid, found: Callable[[], Any], timeout: float) -> Any:
        """Discover the grid's nodes every 0.5 s until ``found()`` is not None (returned) or
        ``timeout`` seconds have passed (None)."""
        deadline = time.monotonic() + timeout
        while True:
            self.directory.discover(grid, query_timeout=max(self.round_timeout, 10.0),
                                    settle=False)
            value = found()
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.5)

    #: Record-level DP (:func:`~fmtl_flower.strategies.ofmtl_privacy.enable_ofmtl_record_dp`)
    #: or None.
    privacy: Any = None

    # Flower's knobs (settings, read from ``settings``: SettingsHome; see :meth:`_check_knobs`)
    min_available_nodes: int
    fraction_train: float
    min_train_nodes: int
    fraction_evaluate: float
    min_evaluate_nodes: int
    train_metrics_aggr_fn: Callable[..., MetricRecord] | None
    evaluate_metrics_aggr_fn: Callable[..., MetricRecord] | None

    @property
    def m(self) -> int:
        """Tasks in the federation now."""
        return 0 if self.W is None else self.W.shape[1]

    # ------------------------------------------------------------------ the run
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int = 0,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None
              ) -> Result:
        """MOCHA over the initial tasks, then admit newcomers until ``num_tasks`` are in (or
        none arrives within ``arrival_timeout``); ``num_rounds`` > 0 caps the newcomers
        (0: no cap). A ValueError at once for a negative ``num_rounds`` or a ``timeout``
        <= 0 (:func:`~fmtl_flower.strategies.base.check_run_length`)."""
        if timeout is None:  # (a strategy still to be built has its settings' timeout)
            timeout = getattr(self, "round_timeout", self.settings.round_timeout)
        num_rounds, timeout = check_run_length(num_rounds, timeout, no_rounds_ok=True)
        collapse_repeated_errors()  # one line per repeated device traceback (Flower's, Ray)
        self.build_from_nodes(grid, timeout)  # num_tasks=None: the tasks online
        self.round_timeout = timeout
        self._check_knobs(initial_arrays, evaluate_fn)
        if self.min_available_nodes:
            wait_for_nodes(grid, self.min_available_nodes,
                           min(self.mocha_options["discovery_timeout"], self.round_timeout),
                           _NAME)
        self._started = time.perf_counter()
        if self.privacy is not None:  # z fixed for the run, before any release
            self.privacy.start(self)
        resumed = (self.checkpoint_dir is not None and self._resume and self._restore())
        if not resumed:
            self._learn_path(grid)
            self._retrain(grid, self.initial_tasks, "initial")
        attempts = admitted = 0
        while self.m < self.num_tasks and (not num_rounds or admitted < num_rounds):
            task = self.m
            node = self._wait_for(grid, task)
            if node is None:
                log(WARNING, "%s: task %d did not appear within %.0f s; ending with %d tasks",
                    _NAME, task, self.arrival_timeout, self.m)
                break
            try:
                self._admit(grid, task, node)
                attempts, admitted = 0, admitted + 1
            except NewcomerFailed as err:
                attempts += 1
                log(WARNING, "%s: newcomer task %d failed (%s); W and Sigma unchanged "
                    "(attempt %d of %d)", _NAME, task, err, attempts, self.max_attempts)
                if attempts >= self.max_attempts:
                    break
                continue
            if self.m - self.tasks_at_training >= self.retrain_ratio * self.tasks_at_training:
                self._retrain(grid, self.m, "retrain")
        return self.result()

    def _check_knobs(self, initial_arrays: ArrayRecord | None,
                     evaluate_fn: Callable[..., Any] | None = None) -> None:
        """Of Flower's knobs (:mod:`fmtl_flower.strategies.base`) OFMTL honours
        ``min_available_nodes``; it has no single global start (MOCHA retrains from
        alpha = 0 at each event), trains every device and reports its own per-event metrics,
        so the others (``evaluate_fn`` included: there are no rounds of one global model to
        evaluate centrally) are a ValueError unless left at their defaults."""
        if evaluate_fn is not None:
            raise ValueError(f"{_NAME} has no global model per round to evaluate centrally: "
                             "evaluate_fn must be None (the per-event test errors are in "
                             "results())")
        if initial_arrays is not None and len(initial_arrays):
            raise ValueError(f"{_NAME} has no single global start to seed: initial_arrays "
                             f"must be None or empty, got keys {sorted(initial_arrays)}")
        value = self.min_available_nodes
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"min_available_nodes must be an int >= 0, got {value!r}")
        if self.fraction_train != 1.0 or self.min_train_nodes:
            raise ValueError(f"{_NAME} trains every device; fraction_train and "
                             "min_train_nodes must keep their defaults (1.0, 0)")
        check_evaluate_knobs(self, _NAME)
        for key in ("train_metrics_aggr_fn", "evaluate_metrics_aggr_fn"):
            if getattr(self, key) is not None:
                raise ValueError(f"{_NAME} reports its own per-event metrics; {key} is not "
                                 "supported")

    def result(self) -> Result:
        """Flower's ``Result`` of the run: per event (keyed by its ``round``), the event's
        numbers as train metrics (devices, floats communicated, times, newcomer gap) and the
        test errors and accuracies as evaluate metrics; ``arrays``: ``W`` (d, m)."""
        result = Result()
        if self.W is not None:
            result.arrays = ArrayRecord({"W": to_array(np.ascontiguousarray(self.W))})
        for record in self.records:
            numbers = {k: float(v) if isinstance(v, float) else v for k, v in record.items()
                       if isinstance(v, int | float) and not isinstance(v, bool)
                       and math.isfinite(v)}
            evaluated = {k: v for k, v in numbers.items()
                         if k.startswith(("test_error", "accuracy"))}
            rnd = int(record["round"])
            result.train_metrics_clientapp[rnd] = MetricRecord(
                {k: v for k, v in numbers.items() if k not in evaluated})
            if evaluated:
                result.evaluate_metrics_clientapp[rnd] = MetricRecord(evaluated)
        return result

    def _wait_for(self, grid: Grid, task: int) -> int | None:
        return self._poll(grid, lambda: self.directory.task_to_node.get(task),
                          self.arrival_timeout)

    # ------------------------------------------------------------------ MOCHA (re)training
    def _retrain(self, grid: Grid, m: int, event: str) -> None:
        """Train MOCHA from scratch over tasks 0 .. m - 1; take its W and Sigma (on the
        factored path MOCHA's factor of Sigma, V diag(s) V^T + c I, as is)."""
        started = time.perf_counter()
        mocha = MOCHA(m, **self.mocha_options, server_path=self.path,
                      task_owners=self.settings.task_owners)
        mocha.directory.outside_level = INFO  # held-back newcomers are expected
        if self.privacy is not None:  # MOCHA's record-level DP, the run's clip and z
            enable_record_dp(mocha, self.privacy.mocha_settings())
        try:
            mocha.start(grid=grid, num_rounds=self.mocha_rounds, timeout=self.round_timeout)
        finally:  # its releases count, even when it does not complete
            if self.privacy is not None and mocha.privacy.accountant is not None:
                self.privacy.add_training(mocha.privacy.accountant.counts[:m])
                self._save_account()
        if mocha.state is None or not mocha.results()["final"].get("complete"):
            raise RuntimeError(f"{_NAME}: MOCHA over {m} tasks did not complete; see the log")
        self.W = np.array(mocha.state.W, copy=True)
        self.directory.fix_dim(self.W.shape[0])
        if self.path == "factored":  # FactoredProbabilistic: an immutable FactoredMatrix
            self.Sigma = mocha.state.formulation.sigma_factor
        else:
            self.Sigma = np.array(mocha.state.formulation.sigma, copy=True)
        d = self.W.shape[0]
        # per round and task: w_t, m_tt and sigma' down (d + 2), delta-b up (d); the final
        # evaluate: w_t (as the ofmtl-arrivals reproduction counts)
        floats = self.mocha_rounds * m * (2 * d + 2) + m * d
        self.floats_total += floats
        self.tasks_at_training = m
        if event == "retrain":
            self.retrainings += 1
        self._record(grid, event, floats, time.perf_counter() - started)

    # ------------------------------------------------------------------ the newcomer protocol
    def _admit(self, grid: Grid, task: int, node: int) -> None:
        """Run the protocol with the newcomer on a copy of (W, Sigma); commit on success."""
        assert self.W is not None and self.Sigma is not None
        started = time.perf_counter()
        d, m = self.W.shape
        W_old = self.W
        ops = server_ops(self.Sigma)  # the dense functions, or their factored counterparts
        sigma = ops.extend_sigma(self.Sigma)
        omega_mat = ops.omega_from_sigma(sigma)
        W_ext = np.hstack([W_old, np.zeros((d, 1))])
        floats = 0
        gap = None
        for step in range(self.outer):
            omega, c = ops.newcomer_server_quantities(W_old, omega_mat)
            w, gap = self._newcomer_step(grid, task, node, step, omega, c)
            floats += 2 * d + 1
            W_ext[:, m] = w
            if step < self.outer - 1:  # never end on an Omega-step: w is optimal for Sigma
                try:
                    sigma, omega_mat = ops.omega_step(W_ext, self.omega_eps)
                except Exception as err:  # noqa: BLE001 - the attempt fails, W and Sigma kept
                    raise NewcomerFailed(f"the Omega-step after step {step} failed: "
                                         f"{type(err).__name__}: {err}") from None
        if not all_finite(W_ext, *((sigma,) if isinstance(sigma, np.ndarray) else ())):
            raise NewcomerFailed("the protocol left W or Sigma non-finite")
        self.W, self.Sigma = W_ext, sigma
        self.newcomer_floats.append(floats)
        self.floats_total += floats
        self._record(grid, "newcomer", floats, time.perf_counter() - started, gap=gap)

    def _newcomer_step(self, grid: Grid, task: int, node: int, step: int, omega: float,
                       c: np.ndarray) -> tuple[np.ndarray, float]:
        config = ConfigRecord({"task-id": task, "step": step, "inner-rounds": self.inner,
                               "seed": self.seed, "omega": float(omega), "lambda": self.lam,
                               "local-frac": self.newcomer_frac,
                               **({} if self.loss == "hinge" else {"loss": self.loss}),
                               **({} if self.privacy is None else self.privacy.wire_config())})
        sent = OFMTLSentExchange.newcomer(NEWCOMER, config, task, node, c,
                                          exchange=self.replies.begin())
        msg = sent.exchange.track(task, node, Message(
            RecordDict({"arrays": ArrayRecord({"c": to_array(sent.c)}),
                        "config": ConfigRecord(dict(sent.config))}),
            dst_node_id=node, message_type=NEWCOMER, group_id=f"ofmtl-{task}"))
        if self.privacy is not None:  # a release, counted when sent
            self.privacy.count_newcomer(task)
            self._save_account()
        out = self.replies.read(sent.where,
                                grid.send_and_receive([msg], timeout=self.round_timeout),
                                lambda reply, t: {"w-gap": self._read_newcomer(reply, t, sent)},
                                exchange=sent.exchange)
        if task in out.accepted:
            return out.accepted[task]["w-gap"]
        if task in out.failed:
            raise NewcomerFailed(f"step {step}: {out.failed[task]}")
        raise NewcomerFailed(f"no reply to step {step} within {self.round_timeout:.0f} s")

    def _read_newcomer(self, reply: Message, task: int, sent: OFMTLSentExchange
                       ) -> tuple[np.ndarray, float]:
        """The newcomer's (w, gap), checked against the step ``sent`` (its step, omega, c)."""
        step, omega, c = sent.step, sent.omega, sent.c
        assert c is not None
        metrics = read_metrics(reply, ints=("task-id", "step", "state-ok"), numbers=("gap",))
        check_task_and_round(metrics, task, step, round_key="step")
        arrays = arrays_of(reply)
        if arrays is None or "w" not in arrays:
            raise ReplyError("array 'w' missing")
        gap = metrics["gap"]
        if step > 0 and metrics["state-ok"] != 1:
            raise ReplyError("the device lost its dual state mid-protocol")
        w = from_array(arrays["w"])
        d = sent.d
        if w.dtype != np.float64 or w.shape != (d,) or not np.all(np.isfinite(w)):
            raise ReplyError(f"'w' must be finite float64 of shape ({d},), got {w.dtype} "
                             f"{w.shape}")
        bound = float(self.directory.row_norm[task])
        if self.privacy is not None:  # rows clipped to C; w carries the release's noise
            bound = float(np.fmin(bound, self.privacy.clip)) + self.privacy.newcomer_allowance(
                int(self.directory.n_train[task]), d, self.lam, omega)
        if math.isnan(bound):
            raise ReplyError("the newcomer reported no max-row-norm at discovery: its w cannot "
                             "be bounded")
        lam_omega = self.lam * omega
        w_norm, c_norm = float(norm(w)), float(norm(c))
        if not math.isfinite(w_norm):
            raise ReplyError("|w| overflows")
        radius = self.loss_fn.dual_radius  # |y_i alpha_i| <= radius: 1, or inf (unbounded)
        if math.isfinite(radius):
            rounding = 1e-9 * (lam_omega * w_norm + self.lam * c_norm)
            check_bound("|lambda omega w + lambda c|", norm(lam_omega * w + self.lam * c),
                        bound * radius + rounding, "max-row-norm %g times the %s loss's dual "
                        "radius %g >= |X^T alpha / n|", bound, self.loss, radius)
        # gap = mean l - mean D(y alpha) + w^T b with b = lam omega w + lam c at w = w(alpha)
        # (core.ofmtl.newcomer_duality_gap): at most the loss's value bound at R |w|, plus
        # lam omega |w|^2 + lam |c| |w|, less the least the dual's data term can be (0 for
        # the hinge, the smoothed hinge and the logistic loss; -inf, no bound, for the
        # squared loss). (This bound had (lam omega / 2) |w|^2, the primal's: too tight by
        # (lam omega / 2) |w|^2 whenever D_new(alpha) < 0, which could refuse an honest gap.)
        ceiling = (float(self.loss_fn.value_bound(bound * w_norm))
                   + lam_omega * w_norm ** 2 + self.lam * c_norm * w_norm)
        check_bound("gap", gap, ceiling - float(self.loss_fn.dual_range[0]),
                    "the loss's bound plus w^T b, which bounds the gap")
        return np.array(w), (math.nan if self.privacy is not None else float(gap))

    # ------------------------------------------------------------------ records
    def _record(self, grid: Grid, event: str, floats: int, seconds: float,
                gap: float | None = None) -> None:
        """Evaluate every present task with its column of W and append the record."""
        assert self.W is not None
        errors, counts = self._evaluate(grid)
        self._ever_replied.update(int(t) for t in errors)
        record: dict[str, Any] = round_record(
            len(self.records), event=event, devices=self.m, floats_communicated=int(floats),
            cumulative_floats=int(self.floats_total), event_time_s=seconds,
            wall_time_s=time.perf_counter() - self._started, retrainings=self.retrainings,
            newcomer_gap=None if gap is None or math.isnan(gap) else gap,
            tasks_missing=sorted(set(range(self.m)) - set(errors)))
        if self.privacy is not None:
            record.update(self.privacy.record_fields())
        if errors and not record["tasks_missing"]:
            tasks = sorted(errors)
            record.update(error_summary(np.array([errors[t] for t in tasks]),
                                        np.array([counts[t] for t in tasks])))
        self.book.add(record)
        log(INFO, "%s: %s -> %d tasks, test error %s, %d floats", _NAME, event, self.m,
            record.get("test_error"), floats)
        if self.checkpoint_dir is not None:
            self._write_checkpoint()
        self.book.publish(record, self.on_record)

    def _evaluate(self, grid: Grid) -> tuple[dict[int, int], dict[int, int]]:
        assert self.W is not None
        self.directory.discover(grid, query_timeout=max(self.round_timeout, 10.0))
        chosen = {task: node for task in range(self.m)
                  if (node := self.directory.task_to_node.get(task)) is not None}
        sent = OFMTLSentExchange.evaluation(EVALUATE, len(self.records), chosen,
                                            self.W.shape[0], exchange=self.replies.begin())
        messages = []
        for task, node in sent.chosen.items():
            config = ConfigRecord({"task-id": task, **sent.config})
            content = RecordDict({"arrays": ArrayRecord({"w": to_array(self.W[:, task])}),
                                  "config": config})
            messages.append(sent.exchange.track(task, node, Message(
                content, dst_node_id=node, message_type=EVALUATE,
                group_id=f"ofmtl-eval-{sent.server_round}")))
        accepted = self.replies.read(
            sent.where, grid.send_and_receive(messages, timeout=self.round_timeout),
            partial(self._read_evaluation, sent=sent), exchange=sent.exchange).accepted
        errors = {t: r["test-errors"] for t, r in accepted.items()}
        counts = {t: r["test-n"] for t, r in accepted.items()}
        return errors, counts

    @staticmethod
    def _read_evaluation(reply: Message, task: int, sent: OFMTLSentExchange
                         ) -> dict[str, Any]:
        """A device's test errors, checked against the evaluation ``sent`` (its task and
        ``server-round``, echoed as ``round``)."""
        out = read_metrics(reply, ints=("task-id", "round", "test-errors", "test-n"))
        check_task_and_round(out, task, sent.server_round)
        if not 0 <= out["test-errors"] <= out["test-n"]:
            raise ReplyError("test-errors outside 0..test-n")
        return out

    def results(self) -> dict[str, Any]:
        """``{"rounds": records, "final": last record + totals}``."""
        final = dict(self.records[-1]) if self.records else {}
        never = set(range(self.num_tasks)) - self._ever_replied
        final.update(retrainings=self.retrainings, newcomer_floats=list(self.newcomer_floats),
                     tasks_never_replied=sorted(int(t) for t in never),
                     complete=self.m == self.num_tasks)
        if self.privacy is not None:
            final.update(self.privacy.record_fields())
            final["privacy"] = {"mechanism": "record", "delta": self.privacy.settings.delta,
                                "noise_multiplier": self.privacy.noise_multiplier,
                                "clip": self.privacy.clip,
                                "epsilon_per_task": self.privacy.epsilons()}
        return {"rounds": self.book.published(), "final": final}

    # ------------------------------------------------------------------ Strategy's abstract API
    # The run is driven by start(); the per-round hooks of the base class are not used.
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:  # noqa: D102
        return []

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:  # noqa: D102
        return None, None

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:  # noqa: D102
        return []

    def aggregate_evaluate(self, server_round: int,
                           replies: Iterable[Message]) -> MetricRecord | None:  # noqa: D102
        return None

    def summary(self) -> None:  # noqa: D102
        log(INFO, "\t└── %s: %d initial tasks of %d, lambda=%g, outer=%d x inner=%d, "
            "retrain-ratio=%g", _NAME, self.initial_tasks, self.num_tasks, self.lam,
            self.outer, self.inner, self.retrain_ratio)
