"""What the strategies over one linear model per task (MOCHA, Mb-SGD) share.

:class:`LinearTasks` is a mixin for :class:`~fmtl_flower.strategies.base.TaskStrategy`
subclasses whose task t sends and receives one model ``w_t`` (a column of W) and reports the
mean loss at it (the hinge's, or the strategy's ``loss``, :mod:`fmtl_flower.core.losses`):
the final metrics round (``configure_evaluate`` /
``aggregate_evaluate``), the row-norm bound R_t of each task, the checks of the replies' loss
against it (:meth:`LinearTasks._bound_rows`, one vectorised check for one-task replies and a
stacked reply's rows alike: a packed node and an unpacked one have the same replies rejected
for the same reasons) and of their test counts, and the completion of a round record from the
replies (primal, objective, test errors). The strategy supplies the round's messages and
replies through the hooks below.

Robust mode (``robust``, the default) bounds a task's replies with R~_t, not with the R_t its
device claims: R~_t = min(R_t, the federation's log-scale upper fence of the reported R's
(:func:`~fmtl_flower.core.robust.log_upper_fence`: at most 10 times their median, more only
when the honest values themselves spread that widely), the discovery limit
``TaskDirectory.max_row_norm``) (:meth:`LinearTasks._row_norms`); a configured
``max_row_norm`` overrides both, as before. Likewise the ``n-train`` the local budgets are
computed from is capped by the fence of the reported n's (:meth:`LinearTasks._budget_sizes`),
so a device claiming 1e9 examples neither gets a huge budget nor (Mb-SDCA) shrinks everyone's
update scale through the round's total of steps. ``robust=False``: each device's word.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from ..core.certificate import certificate_rejections
from ..core.losses import get_loss
from ..core.robust import log_upper_fence
from ..metrics import error_summary
from .discovery import ReplyError
from .records import RoundRecords
from .trust import BOUND_SLACK, ReplyBoundary

__all__ = ["LinearTasks"]

#: Why a reply's ``loss-mean`` is bounded (in the reason of a rejection).
LOSS_BOUND = "1 + max-row-norm |w_t| >= hinge(y x^T w_t)"
#: The same for a loss other than the hinge (formatted with its name).
LOSS_BOUND_OF = "the {} loss at margins |y x^T w_t| <= max-row-norm |w_t|"

#: Why every reply of a task without R_t is rejected.
NO_ROW_NORM = ("its device reported no max-row-norm at discovery and the run configures none "
               "(max-row-norm): its replies cannot be bounded")

Replies = dict[int, dict[str, Any]]


class LinearTasks:
    """Mixin: the final metrics round, row-norm bounds and record completion of a strategy
    with one linear model w_t per task.

    The class using it has the :class:`~fmtl_flower.strategies.base.TaskStrategy` attributes
    (``num_tasks``, ``num_rounds``, ``records`` and their ``book``, ``directory``,
    ``on_round``), a :class:`~fmtl_flower.strategies.trust.ReplyBoundary` ``replies``,
    and ``max_row_norm``, and implements
    :meth:`_final_instructions` and :meth:`_final_replies`.
    """

    num_tasks: int
    robust: bool
    num_rounds: int | None
    records: list[dict[str, Any]]
    book: RoundRecords
    max_row_norm: float | None
    #: True when the devices withhold ``loss-mean`` / ``dual-mean`` (MOCHA's record-level DP):
    #: the records then have no primal, dual or gap.
    withholds_objective: bool = False
    directory: Any
    on_round: Any
    replies: ReplyBoundary

    # ------------------------------------------------------------------ hooks
    def _final_instructions(self, server_round: int, grid: Grid) -> Iterable[Message]:
        """The messages of the final metrics round (every task, ``eval`` on, no budget)."""
        raise NotImplementedError

    def _final_replies(self, server_round: int, replies: Iterable[Message]) -> Replies:
        """The validated replies of the final metrics round, keyed by task."""
        raise NotImplementedError

    def _consistent_tasks(self, accepted: Replies) -> list[int]:
        """The replying tasks whose numbers describe the state the record is about."""
        return list(accepted)

    def _complete_dual(self, record: dict[str, Any], accepted: Replies, reg: float) -> None:
        """Fill the record's dual numbers, when the method has any (every task replied)."""

    # ------------------------------------------------------------------ final metrics round
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Nothing, except after the last round: the final metrics round over every task."""
        if self.num_rounds is None or server_round != self.num_rounds:
            return []
        return self._final_instructions(server_round, grid)

    def aggregate_evaluate(self, server_round: int,
                           replies: Iterable[Message]) -> MetricRecord | None:
        """Complete the final record from the metrics round."""
        if self.num_rounds is None or server_round != self.num_rounds:
            return None
        record = self._complete_record(server_round, self._final_replies(server_round, replies))
        return MetricRecord({k: float(v) for k, v in record.items()
                             if isinstance(v, int | float) and not isinstance(v, bool)})

    @property
    def _sent(self) -> dict[int, int]:
        """node -> task of the round's messages."""
        return self.replies.sent

    # ------------------------------------------------------------------ bounds
    def _check_tests(self, out: dict[str, Any]) -> None:
        """A reply's ``test-errors`` / ``test-n``: both or neither, 0 <= errors <= n <= the
        discovery limit ``max_n``; ReplyError if broken."""
        if out.get("test-n", 0) > self.directory.max_n:
            raise ReplyError(f"test-n {out['test-n']} above the limit {self.directory.max_n}")
        if ("test-errors" in out) != ("test-n" in out) or (
                "test-n" in out and not 0 <= out["test-errors"] <= out["test-n"]):
            raise ReplyError("test-errors/test-n inconsistent")

    def _row_norms(self, tasks: np.ndarray) -> np.ndarray:
        """R_t of ``tasks``: the configured max-row-norm, else the tasks' reports (NaN:
        none), in robust mode capped by the federation's fence (module docstring)."""
        if self.max_row_norm is not None:
            return np.full(len(tasks), self._lift_row_norms(self.max_row_norm))
        reported = self._lift_row_norms(self.directory.row_norm[tasks])
        if not self.robust:
            return reported
        return np.minimum(reported, self._row_norm_cap())

    def _lift_row_norms(self, norms: Any) -> Any:
        """The row norms of the data the devices train on, from those of the data they
        report (MOCHA's intercept adds a constant feature: :meth:`MOCHA._lift_row_norms`);
        here the same."""
        return norms

    def _row_norm_cap(self) -> float:
        """The largest R_t robust mode believes: the fence of every task's reported R_t, at
        most the discovery limit (computed once per change of the reports)."""
        reported = self._lift_row_norms(self.directory.row_norm)
        key = reported.tobytes()
        cached = getattr(self, "_row_norm_cap_of", None)
        if cached is None or cached[0] != key:
            cap = min(log_upper_fence(reported),
                      float(self._lift_row_norms(float(self.directory.max_row_norm))))
            self._row_norm_cap_of = cached = (key, cap)
        return cached[1]

    def _budget_sizes(self, tasks: np.ndarray) -> np.ndarray:
        """The ``n-train`` of ``tasks`` the local budgets are computed from: as reported, in
        robust mode capped by the log-scale upper fence of every known task's n-train."""
        n = self.n_train[tasks]
        if not self.robust or n.size == 0:
            return n
        cap = min(log_upper_fence(self.n_train[self.n_train > 0]),
                  float(self.directory.max_n))  # (a fence can pass what an int64 holds)
        return np.minimum(n, math.floor(cap)).astype(n.dtype, copy=False)

    def _bound_rows(self, rows: Replies, tasks: np.ndarray, rejected: dict[int, str],
                    w_norm: np.ndarray) -> np.ndarray:
        """The bounds every reply of a task shares, vectorised over the parsed replies
        ``rows`` of ``tasks`` (one-task replies and a stacked reply's rows alike, in every
        round, the final metrics round's too): a task without R_t cannot be bounded
        (:data:`NO_ROW_NORM`), else ``loss-mean`` must be at most 1 + R_t |w_t| for the hinge
        (``w_norm``: |w_t| as sent in the replies' exchange, its
        :class:`~fmtl_flower.strategies.round_state.SentRound`'s), the loss's
        ``value_bound(R_t |w_t|)`` for the strategy's ``loss`` otherwise. Adds the broken ones
        to ``rejected`` (a task already there keeps its reason); returns the tasks' R_t (NaN:
        none)."""
        bound = self._row_norms(tasks)
        loss = np.array([rows[t]["loss-mean"] for t in tasks.tolist()], dtype=np.float64)
        loss_fn = get_loss(getattr(self, "loss", "hinge"))
        limit = loss_fn.value_bound(bound * w_norm[tasks])
        why = LOSS_BOUND if loss_fn.name == "hinge" else LOSS_BOUND_OF.format(loss_fn.name)
        for i in np.flatnonzero(~(loss <= limit * BOUND_SLACK)).tolist():  # NaN limit too
            rejected.setdefault(int(tasks[i]), NO_ROW_NORM if math.isnan(limit[i]) else (
                f"loss-mean = {loss[i]:.6g} above its bound {limit[i]:.6g} ({why})"))
        return bound

    # ------------------------------------------------------------------ records
    def _complete_record(self, k: int, accepted: Replies) -> dict[str, Any]:
        """Complete record k from the replies that describe state k: primal and objective
        (and the dual numbers) when every task replied consistently, else ``tasks_missing``
        says which did not; ``gap_certified`` (a gap, so every task's pair passed the
        certificate's check) and ``certificate_rejections`` (the replies that failed it);
        the test errors when evaluated. Passes it to ``on_round``.
        A record completed already (the last record of a finished run that was resumed with
        more rounds, completed by its final metrics round) stays as it is
        (:mod:`~fmtl_flower.strategies.records`)."""
        record = self.records[k]
        pending = self.book.complete(k)
        if pending is None:
            return record
        consistent = self._consistent_tasks(accepted)
        missing = sorted(set(range(self.num_tasks)) - set(consistent))
        record["tasks_missing"] = missing
        reg = pending.regulariser
        if not missing and not self.withholds_objective:
            loss = np.array([accepted[t]["loss-mean"] for t in range(self.num_tasks)])
            record["primal"] = float(loss.sum()) + reg
            self._complete_dual(record, accepted, reg)
            record["objective"] = record["primal"] + record["objective_omega"]
        record["gap_certified"] = record.get("gap") is not None  # every pair passed its check
        last = self.replies.last  # the exchange whose replies complete this record
        record["certificate_rejections"] = 0 if last is None else \
            certificate_rejections(last.failed)
        evaluated = [t for t in consistent if "test-n" in accepted[t]]
        if evaluated and not missing:
            errors = np.array([accepted[t]["test-errors"] for t in evaluated])
            counts = np.array([accepted[t]["test-n"] for t in evaluated])
            record.update(error_summary(errors, counts))
        self.book.publish(record, self.on_round)
        return record
